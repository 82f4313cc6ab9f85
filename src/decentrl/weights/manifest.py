"""Manifests: the signed description of one published weight version (no torch, no numpy).

A version is published as a byte stream (the *payload*: every tensor's encoding, one after the
other) cut into content-addressed chunks. Its manifest names the tensors (name, dtype, shape,
encoding, byte range in the payload), the chunks (sha256, size, byte range) and the sha256 of the
fully reconstructed state, and carries the trainer's Ed25519 signature over everything else.
A delta also names its parent version and the parent's state hash, so a chain of deltas is
verified link by link. A *patch* names an anchor version s < version instead: it overwrites every
element that changed in any version of (s, version] with its value at `version`, so it turns the
state of any version a with s <= a < version into this one (elements outside that union never
changed since s). The coordinator parses and checks manifests with this module alone.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

FORMAT = 2
"""Bumped whenever the payload encoding changes (2: sparse stores new ^ old, not new values)."""
Kind = Literal["snapshot", "delta", "patch"]
Encoding = Literal["raw", "sparse", "xor", "same", "scatter"]
"""raw: the tensor's bytes (snapshots; in a patch, the whole tensor overwritten); sparse: changed
positions + new ^ old; xor: new ^ old; same: unchanged (no bytes); scatter: positions + new values
(patches: an overwrite that does not depend on the exact base). See `codec.py`."""
ENCODINGS: dict[str, frozenset[str]] = {
    "snapshot": frozenset({"raw"}),
    "delta": frozenset({"sparse", "xor", "same"}),
    "patch": frozenset({"raw", "scatter", "same"}),
}
"""What each kind may use: a delta's encodings depend on the exact parent state, so a patch (which
applies to several states) may only overwrite."""
DType = Literal["bfloat16", "float16", "float32"]
ManifestKey = tuple[int, str, int | None]
"""(version, kind, anchor): one manifest; the anchor is None except for patches."""
SHA256_HEX = r"^[0-9a-f]{64}$"
MAX_ENTRIES = 1 << 20


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorEntry(Strict):
    name: str = Field(..., min_length=1, max_length=512)
    dtype: DType
    shape: list[int] = Field(..., max_length=16)
    encoding: Encoding
    offset: int = Field(..., ge=0)
    """Start of this tensor's encoded bytes in the payload."""
    length: int = Field(..., ge=0)


class ChunkEntry(Strict):
    sha256: str = Field(..., pattern=SHA256_HEX)
    offset: int = Field(..., ge=0)
    size: int = Field(..., ge=1)


class Manifest(Strict):
    format: int = FORMAT
    version: int = Field(..., ge=0)
    kind: Kind
    parent: int | None = None
    """The version a delta applies to (always `version - 1`); None for a snapshot."""
    parent_state_sha256: str | None = Field(default=None, pattern=SHA256_HEX)
    anchor: int | None = Field(default=None, ge=0)
    """A patch applies to the state of any version in [anchor, version); None for other kinds."""
    anchor_state_sha256: str | None = Field(default=None, pattern=SHA256_HEX)
    """The anchor's state hash (a patch's link to the history the coordinator checks)."""
    dtype: DType
    """The inference dtype every tensor is published in."""
    tensors: list[TensorEntry] = Field(..., max_length=MAX_ENTRIES)
    chunks: list[ChunkEntry] = Field(..., max_length=MAX_ENTRIES)
    payload_bytes: int = Field(..., ge=0)
    state_sha256: str = Field(..., pattern=SHA256_HEX)
    """`codec.state_hash` of the state this version reconstructs to."""
    signature: str = ""
    """Ed25519 signature (hex) by the trainer's key over `signed_bytes(manifest)`."""

    @property
    def key(self) -> ManifestKey:
        """What names this manifest among a version's (there may be several patches per version)."""
        return (self.version, self.kind, self.anchor)


def signed_bytes(manifest: Manifest) -> bytes:
    """The canonical bytes the trainer signs: sorted-key compact JSON of every field but the signature.
    The one function both signer and verifiers use (STYLE 8)."""
    fields = manifest.model_dump(exclude={"signature"})
    for name in ("anchor", "anchor_state_sha256"):  # absent, not null, so older signatures still verify
        if fields[name] is None:
            del fields[name]
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def check_layout(manifest: Manifest) -> str | None:
    """What is structurally wrong with a manifest (None when it is consistent): chunks must tile the
    payload exactly, tensors must lie inside it, each kind uses only its encodings, a delta names its
    parent, a patch its anchor, a snapshot neither."""
    if manifest.format != FORMAT:
        return (
            f"payload format {manifest.format} is not the one this build reads ({FORMAT}); upgrade decentrl"
        )
    position = 0
    for chunk in manifest.chunks:
        if chunk.offset != position:
            return f"chunk at offset {chunk.offset} does not follow the previous one (expected {position})"
        position += chunk.size
    if position != manifest.payload_bytes:
        return f"chunks cover {position} bytes, payload_bytes says {manifest.payload_bytes}"
    for tensor in manifest.tensors:
        if tensor.offset + tensor.length > manifest.payload_bytes:
            return f"tensor {tensor.name} lies outside the payload"
        if tensor.encoding not in ENCODINGS[manifest.kind]:
            return f"{manifest.kind} tensor {tensor.name} has encoding {tensor.encoding}"
    if len({t.name for t in manifest.tensors}) != len(manifest.tensors):
        return "a tensor name appears twice"
    has_parent = manifest.parent is not None or manifest.parent_state_sha256 is not None
    has_anchor = manifest.anchor is not None or manifest.anchor_state_sha256 is not None
    if manifest.kind == "delta":
        if manifest.parent != manifest.version - 1 or manifest.parent_state_sha256 is None:
            return "a delta must name parent = version - 1 and the parent's state hash"
        if has_anchor:
            return "a delta has no anchor"
    elif manifest.kind == "patch":
        if (
            manifest.anchor is None
            or manifest.anchor >= manifest.version
            or manifest.anchor_state_sha256 is None
        ):
            return "a patch must name an anchor below its version and the anchor's state hash"
        if has_parent:
            return "a patch has no parent"
    elif has_parent or has_anchor:
        return "a snapshot has no parent or anchor"
    return None
