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

A *staged* run (a policy split into pipeline stages, `stage_map.py`) adds the run's stage map and one
section per stage: the tensors that stage holds, the chunks that hold their bytes (and no other
stage's: the publisher cuts chunks at the boundaries between stage groups), and the stage's own
state hash with its parent's or anchor's. A stage holder fetches, decodes and verifies its section
alone (`sections.part`); everything else reads the whole payload and `state_sha256` as before.

A *stage trainer's* manifest (a run trained by K stage trainers, `trainer.pipeline_stages`) names the
run's stage map and the one `stage` it carries: only that stage's tensors, its state hash that
stage's, signed by that stage trainer's own key. A version then has K such manifests of each kind,
and is published once every stage's is in.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from decentrl.stage_map import LAYER, StageMap, StageMapError

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


class StageSection(Strict):
    """What the holders of one pipeline stage need of a staged version."""

    stage: int = Field(..., ge=0)
    tensors: list[str] = Field(..., max_length=MAX_ENTRIES)
    """The names this stage holds, sorted: `stage_map.names(stage, every tensor)`."""
    chunks: list[int] = Field(..., max_length=MAX_ENTRIES)
    """Increasing indices into the manifest's `chunks`: those holding bytes of these tensors."""
    state_sha256: str = Field(..., pattern=SHA256_HEX)
    """`codec.state_hash` of this stage's tensors as the version reconstructs them."""
    parent_state_sha256: str | None = Field(default=None, pattern=SHA256_HEX)
    """A delta's: the same hash of the parent version's stage tensors."""
    anchor_state_sha256: str | None = Field(default=None, pattern=SHA256_HEX)
    """A patch's: the same hash of the anchor version's stage tensors."""


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
    stage_map: StageMap | None = None
    """The run's pipeline stages; None when the run is not staged."""
    stages: list[StageSection] | None = Field(default=None, max_length=1024)
    """One section per stage, in stage order (a staged run only)."""
    stage: int | None = Field(default=None, ge=0)
    """A stage trainer's manifest: the one stage whose tensors it carries (then no `stages`)."""
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
    # absent, not null, so the signatures of manifests without these fields stay what they were
    for name in ("anchor", "anchor_state_sha256", "stage_map", "stages", "stage"):
        if fields[name] is None:
            del fields[name]
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def check_layout(manifest: Manifest) -> str | None:
    """What is structurally wrong with a manifest (None when it is consistent): chunks must tile the
    payload exactly, tensors must lie inside it, each kind uses only its encodings, a delta names its
    parent, a patch its anchor, a snapshot neither; a staged manifest's sections are what its stage
    map makes of its tensors (`_check_stages`)."""
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
    if manifest.stage is not None:
        return _check_one_stage(manifest)
    if (manifest.stage_map is None) != (manifest.stages is None):
        return "a staged manifest names its stage map and its sections, an unstaged one neither"
    return None if manifest.stage_map is None else _check_stages(manifest, manifest.stage_map)


def _check_one_stage(manifest: Manifest) -> str | None:
    """A stage trainer's manifest: the run's map, no sections, and exactly one stage's tensors
    (every layer of that stage and no other's; the embedding at stage 0 and, tied, the last)."""
    stage_map, stage = manifest.stage_map, manifest.stage
    assert stage is not None
    if stage_map is None or manifest.stages is not None:
        return "a stage trainer's manifest names the stage map and its stage, and has no sections"
    if stage >= stage_map.num_stages:
        return f"stage {stage} does not exist in a map of {stage_map.num_stages} stages"
    try:
        foreign = [t.name for t in manifest.tensors if stage not in stage_map.stages_of(t.name)]
    except StageMapError as error:
        return str(error)
    if foreign:
        return f"a manifest of stage {stage} carries {foreign[0]}, which stage {stage} does not hold"
    layers = {int(match.group(1)) for tensor in manifest.tensors if (match := LAYER.match(tensor.name))}
    if layers != set(stage_map.layers(stage)):
        return f"a manifest of stage {stage} must carry every layer of it, {list(stage_map.layers(stage))}"
    return None


def tensor_chunks(manifest: Manifest) -> dict[str, range]:
    """The indices of the chunks each tensor's bytes lie in (chunks tile the payload: checked first).
    The one function the publisher's sections and their check use (STYLE 8)."""
    starts = [chunk.offset for chunk in manifest.chunks]
    found = {}
    for tensor in manifest.tensors:
        if tensor.length == 0:
            found[tensor.name] = range(0)
            continue
        first = bisect_right(starts, tensor.offset) - 1
        found[tensor.name] = range(first, bisect_right(starts, tensor.offset + tensor.length - 1, lo=first))
    return found


def _check_stages(manifest: Manifest, stage_map: StageMap) -> str | None:
    """Every tensor is placed by the map and listed in exactly the sections of the stages that hold
    it; each chunk holds bytes of tensors of one stage group only (so a holder never downloads
    another stage's bytes), and each section lists exactly the chunks of its tensors."""
    sections = manifest.stages or []
    if [section.stage for section in sections] != list(range(stage_map.num_stages)):
        return f"a manifest for {stage_map.num_stages} stages has one section per stage, in order"
    try:
        placed = {tensor.name: stage_map.stages_of(tensor.name) for tensor in manifest.tensors}
    except StageMapError as error:
        return str(error)
    layers = {int(match.group(1)) for name in placed if (match := LAYER.match(name))}
    if layers != set(range(stage_map.num_layers)):
        return f"the stage map covers {stage_map.num_layers} layers; the tensors name {len(layers)}"
    if stage_map.tied_embeddings == ("lm_head.weight" in placed):  # a tied head is published once
        return f"the stage map says tied_embeddings = {stage_map.tied_embeddings}; the tensors say otherwise"
    groups: dict[int, set[tuple[int, ...]]] = {}
    needed: dict[int, set[int]] = {stage: set() for stage in range(stage_map.num_stages)}
    for name, indices in tensor_chunks(manifest).items():
        for index in indices:
            groups.setdefault(index, set()).add(placed[name])
            for stage in placed[name]:
                needed[stage].add(index)
    mixed = [index for index, held_by in groups.items() if len(held_by) > 1]
    if mixed:
        return f"chunk {mixed[0]} holds bytes of tensors that different stages hold"
    for section in sections:
        stage = section.stage
        if section.tensors != sorted(name for name, stages in placed.items() if stage in stages):
            return f"section {stage} does not list exactly the tensors stage {stage} holds"
        if section.chunks != sorted(needed[stage]):
            return f"section {stage} does not list exactly the chunks of its tensors"
        links = (section.parent_state_sha256 is not None, section.anchor_state_sha256 is not None)
        if links != (manifest.kind == "delta", manifest.kind == "patch"):
            return f"section {stage} of a {manifest.kind} names the wrong base state hash"
    return None
