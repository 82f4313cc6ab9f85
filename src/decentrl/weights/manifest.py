"""Manifests: the signed description of one published weight version (no torch, no numpy).

A version is published as a byte stream (the *payload*: every tensor's encoding, one after the
other) cut into content-addressed chunks. Its manifest names the tensors (name, dtype, shape,
encoding, byte range in the payload), the chunks (sha256, size, byte range) and the sha256 of the
fully reconstructed state, and carries the trainer's Ed25519 signature over everything else.
A delta also names its parent version and the parent's state hash, so a chain of deltas is
verified link by link. The coordinator parses and checks manifests with this module alone.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

FORMAT = 2
"""Bumped whenever the payload encoding changes (2: sparse stores new ^ old, not new values)."""
Kind = Literal["snapshot", "delta"]
Encoding = Literal["raw", "sparse", "xor", "same"]
"""raw: the tensor's bytes (snapshots); sparse: changed positions + new values; xor: new ^ old;
same: unchanged (no bytes). See `codec.py`."""
DType = Literal["bfloat16", "float16", "float32"]
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
    parent_state_sha256: str | None = Field(None, pattern=SHA256_HEX)
    dtype: DType
    """The inference dtype every tensor is published in."""
    tensors: list[TensorEntry] = Field(..., max_length=MAX_ENTRIES)
    chunks: list[ChunkEntry] = Field(..., max_length=MAX_ENTRIES)
    payload_bytes: int = Field(..., ge=0)
    state_sha256: str = Field(..., pattern=SHA256_HEX)
    """`codec.state_hash` of the state this version reconstructs to."""
    signature: str = ""
    """Ed25519 signature (hex) by the trainer's key over `signed_bytes(manifest)`."""


def signed_bytes(manifest: Manifest) -> bytes:
    """The canonical bytes the trainer signs: sorted-key compact JSON of every field but the signature.
    The one function both signer and verifiers use (STYLE 8)."""
    fields = manifest.model_dump(exclude={"signature"})
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def check_layout(manifest: Manifest) -> str | None:
    """What is structurally wrong with a manifest (None when it is consistent): chunks must tile the
    payload exactly, tensors must lie inside it, a delta must name its parent and a snapshot not."""
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
        if manifest.kind == "snapshot" and tensor.encoding != "raw":
            return f"snapshot tensor {tensor.name} has encoding {tensor.encoding}"
    if len({t.name for t in manifest.tensors}) != len(manifest.tensors):
        return "a tensor name appears twice"
    if manifest.kind == "delta":
        if manifest.parent != manifest.version - 1 or manifest.parent_state_sha256 is None:
            return "a delta must name parent = version - 1 and the parent's state hash"
    elif manifest.parent is not None or manifest.parent_state_sha256 is not None:
        return "a snapshot has no parent"
    return None
