"""Staged manifests: the payload laid out by stage, and the part of a manifest one consumer reads.

The publisher orders a staged state's tensors by the stages that hold them (`tensor_groups`) and
cuts chunks at the group boundaries, so each chunk holds bytes of one group only. With tied
embeddings the embedding matrix is one group of its own, held by the first and the last stage: both
download it, and neither downloads a byte of the other's layers. A stage holder reads its section as
a `Part` (its chunks, its tensors' byte ranges within them, its hashes); a full-model consumer reads
the whole manifest as one. No torch: the coordinator's index uses `stage_bytes`.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass

from decentrl.stage_map import StageMap
from decentrl.weights.manifest import ChunkEntry, Manifest, StageSection, TensorEntry, tensor_chunks

StageKey = tuple[int, str, int | None, int]
"""(version, kind, anchor, stage): one stage trainer's manifest (a run of stage trainers)."""


def stage_manifest_name(key: StageKey) -> str:
    """A stage trainer's manifest's file name, in the coordinator's store and in a release."""
    version, kind, anchor, stage = key
    middle = kind if anchor is None else f"{kind}-{anchor:08d}"
    return f"v{version:08d}.{middle}.s{stage}.json"


def version_hash(stage_hashes: Iterable[str]) -> str:
    """A version's state hash in a run of stage trainers: sha256 over its stage hashes in order
    (what the coordinator records for it once every stage's manifest is in)."""
    return hashlib.sha256("\n".join(stage_hashes).encode()).hexdigest()


def tensor_groups(stage_map: StageMap, names: list[str]) -> list[list[str]]:
    """The names grouped by the stages that hold them, in payload order: stage 0's own, the tied
    embedding (stages 0 and K-1), then each later stage's own."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for name in sorted(names):
        groups.setdefault(stage_map.stages_of(name), []).append(name)
    return [groups[stages] for stages in sorted(groups)]


def group_starts(tensors: list[TensorEntry], groups: list[list[str]]) -> list[int]:
    """Payload offsets where each group's bytes begin: where chunks must be cut."""
    offsets = {tensor.name: tensor.offset for tensor in tensors}
    return [offsets[group[0]] for group in groups]


def build_sections(
    manifest: Manifest, stage_map: StageMap, state_sha256: list[str], base_sha256: list[str] | None
) -> list[StageSection]:
    """One section per stage of an unsigned manifest whose chunks were cut at the group starts;
    `base_sha256` holds the stage hashes of a delta's parent or a patch's anchor."""
    assert (base_sha256 is None) == (manifest.kind == "snapshot"), manifest.kind
    names = [tensor.name for tensor in manifest.tensors]
    chunks_of = tensor_chunks(manifest)
    sections = []
    for stage in range(stage_map.num_stages):
        held = stage_map.names(stage, names)
        base = None if base_sha256 is None else base_sha256[stage]
        sections.append(
            StageSection(
                stage=stage,
                tensors=held,
                chunks=sorted({index for name in held for index in chunks_of[name]}),
                state_sha256=state_sha256[stage],
                parent_state_sha256=base if manifest.kind == "delta" else None,
                anchor_state_sha256=base if manifest.kind == "patch" else None,
            )
        )
    return sections


def stage_bytes(manifest: Manifest) -> list[int] | None:
    """Payload bytes each stage's holders download (None for an unstaged manifest or a stage
    trainer's, which is all one stage's)."""
    if manifest.stages is None:
        return None
    return [sum(manifest.chunks[index].size for index in section.chunks) for section in manifest.stages]


@dataclass(frozen=True)
class Part:
    """What one consumer reads of a manifest: all of it, or one stage's section."""

    tensors: list[TensorEntry]
    """Its tensors, each `offset` into the concatenation of `chunks`."""
    chunks: list[ChunkEntry]
    state_sha256: str
    parent_state_sha256: str | None
    anchor_state_sha256: str | None

    @property
    def payload_bytes(self) -> int:
        return sum(chunk.size for chunk in self.chunks)


def part(manifest: Manifest, stage: int | None) -> Part:
    """The whole manifest (`stage` None), or the section of `stage` of a staged manifest that passed
    `check_layout`: its tensors' offsets rebased onto its chunks alone (a tensor's chunks are all in
    its section and consecutive in the payload, so they are consecutive there too). A stage
    trainer's manifest is read whole, by its own stage's holders."""
    if stage is None or manifest.stage is not None:
        assert manifest.stage in (None, stage), "checked by the caller"
        return Part(
            manifest.tensors,
            manifest.chunks,
            manifest.state_sha256,
            manifest.parent_state_sha256,
            manifest.anchor_state_sha256,
        )
    assert manifest.stages is not None and stage < len(manifest.stages), "checked by the caller"
    section = manifest.stages[stage]
    chunks = [manifest.chunks[index] for index in section.chunks]
    starts, rebased, position = [chunk.offset for chunk in chunks], [], 0
    for chunk in chunks:
        rebased.append(position)
        position += chunk.size
    held, tensors = set(section.tensors), []
    for tensor in manifest.tensors:
        if tensor.name not in held:
            continue
        offset = 0
        if tensor.length:
            first = bisect_right(starts, tensor.offset) - 1
            offset = rebased[first] + tensor.offset - starts[first]
        tensors.append(tensor.model_copy(update={"offset": offset}))
    return Part(
        tensors, chunks, section.state_sha256, section.parent_state_sha256, section.anchor_state_sha256
    )
