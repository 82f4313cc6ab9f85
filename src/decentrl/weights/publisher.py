"""The trainer's side: publish each version as a signed delta (and periodically a snapshot).

The trainer's master weights stay in its own precision; what is published is their cast to the
inference dtype (`weights.dtype`). Version v is a delta against the published state of v-1, plus
a full snapshot when v is divisible by `snapshot_every` (and whenever no previous state is at
hand: version 0, or the first publish after a restart). Chunks go up first, the manifest last:
the coordinator accepts a manifest only when every chunk it names is stored.

Catch-up patches: the publisher keeps *anchors* (the first version it published, i.e. the run's base
after a start or restart, and the newest snapshot), each with a per-tensor mask of the elements that
changed in any version since it. Every other version v also gets a patch per anchor s (v - s >= 2):
the masked elements' values at v, which turn any state of a version in [s, v) into v. An anchor
whose patch reaches `weights.patch_max_fraction` of its snapshot's payload is dropped (its union
only grows); with full-parameter training at a large learning rate that happens within a few
versions, with LoRA (only the adapters change) never. Patches serve workers that fall behind: while
the coordinator says no worker has been seen lately (`catch_up` off, from the trainer's acks: a
colocated trainer alone), none are made; the anchors' masks still grow, so the first version after
a worker appears carries them again, and a worker that arrives in between catches up by the deltas
and snapshots every version still has.

A staged run (`stage_map`) publishes every manifest with one section per stage (`sections.py`):
tensors ordered by stage group, chunks cut at the group boundaries, each stage's own state hash and
its parent's or anchor's. The full state hash stays, so full-model consumers read it unchanged.

A stage trainer (`stage`) publishes its own stage only: its manifests carry that stage's tensors,
name the run's map and the stage, and are signed by the stage trainer's own key, registered for
that stage. With `weights.store = "peers"` its chunks go into its own chunk store (`chunks`), which
its chunk server serves, instead of up to the coordinator.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from decentrl.client import CoordinatorClient
from decentrl.config import WeightsConfig
from decentrl.protocol import TrainerKey
from decentrl.stage_map import StageMap
from decentrl.weights.chunks import ChunkStore, cut
from decentrl.weights.codec import changed_mask, encode_patch, encode_state, published_state, state_hash
from decentrl.weights.manifest import DType, Kind, Manifest, TensorEntry
from decentrl.weights.sections import build_sections, group_starts, stage_bytes, tensor_groups
from decentrl.weights.signing import load_or_create_key, public_key_hex, sign
from decentrl.weights.unique_storage import state_for_publication

log = logging.getLogger(__name__)


@dataclass
class Published:
    version: int
    kind: Kind
    payload_bytes: int
    state_sha256: str
    encode_seconds: float
    encodings: dict[str, int] = field(default_factory=dict)
    """How many tensors took each encoding."""
    anchor: int | None = None
    """A patch's anchor version."""
    stage_bytes: list[int] | None = None
    """Payload bytes each stage's holders download (a staged run)."""
    chunks: list[str] = field(default_factory=list)
    """The sha256 of each of its chunks."""


NEWER_ANCHOR_GAIN = 0.9
"""A patch against the newest snapshot is published only below this fraction of the patch against
an older anchor at the same version: the older one applies to more held versions."""


@dataclass
class Anchor:
    """A version patches start from, and which elements changed in any version since it."""

    version: int
    state_sha256: str
    snapshot_bytes: int
    """Payload of its snapshot: a patch is worth publishing only well below it."""
    union: dict[str, torch.Tensor]
    """Flat bool mask per tensor that changed since (none for the others: with LoRA the frozen base
    costs no mask)."""
    base: bool
    """The first version this publisher published (kept when newer snapshots come)."""
    stage_sha256: list[str] | None = None
    """Its state hash per stage (a staged run): what its patches' sections name."""


@dataclass(frozen=True)
class Staging:
    """What a staged run's manifest adds: the map and the state hashes per stage."""

    stage_map: StageMap
    state_sha256: list[str]
    """Of the version published."""
    base_sha256: list[str] | None = None
    """Of a delta's parent or a patch's anchor."""


def stage_hashes(state: dict[str, torch.Tensor], stage_map: StageMap | None) -> list[str] | None:
    """`state_hash` of each stage's tensors: what its holder's mirror reconstructs to."""
    if stage_map is None:
        return None
    return [
        state_hash({name: state[name] for name in stage_map.names(stage, list(state))})
        for stage in range(stage_map.num_stages)
    ]


def build_manifest(
    version: int,
    old: dict[str, torch.Tensor] | None,
    new: dict[str, torch.Tensor],
    dtype: DType,
    chunk_bytes: int,
    new_sha256: str,
    old_sha256: str | None = None,
    staging: Staging | None = None,
) -> tuple[Manifest, list]:
    """An unsigned manifest (a delta when `old` is given) and its chunks as (entry, bytes)."""
    groups = _groups(new, staging)
    entries, payload = encode_state(old, new, _order(groups))
    links = {} if old is None else {"parent": version - 1, "parent_state_sha256": old_sha256}
    kind: Kind = "snapshot" if old is None else "delta"
    return _manifest(version, kind, entries, payload, dtype, chunk_bytes, new_sha256, links, staging, groups)


def build_patch(
    version: int,
    new: dict[str, torch.Tensor],
    anchor: Anchor,
    dtype: DType,
    chunk_bytes: int,
    new_sha256: str,
    staging: Staging | None = None,
) -> tuple[Manifest, list]:
    """An unsigned patch of `new` against `anchor` (its union of changes) and its chunks."""
    groups = _groups(new, staging)
    entries, payload = encode_patch(new, anchor.union, _order(groups))
    links = {"anchor": anchor.version, "anchor_state_sha256": anchor.state_sha256}
    return _manifest(
        version, "patch", entries, payload, dtype, chunk_bytes, new_sha256, links, staging, groups
    )


def _groups(state: dict[str, torch.Tensor], staging: Staging | None) -> list[list[str]] | None:
    return None if staging is None else tensor_groups(staging.stage_map, list(state))


def _order(groups: list[list[str]] | None) -> list[str] | None:
    return None if groups is None else [name for group in groups for name in group]


def _manifest(
    version: int,
    kind: Kind,
    entries: list[TensorEntry],
    payload: bytes,
    dtype: DType,
    chunk_bytes: int,
    state_sha256: str,
    links: dict,
    staging: Staging | None,
    groups: list[list[str]] | None,
) -> tuple[Manifest, list]:
    # Chunks end where a stage group ends: a stage holder downloads no other stage's bytes.
    boundaries = [] if groups is None else group_starts(entries, groups)
    pieces = cut(payload, chunk_bytes, boundaries)
    manifest = Manifest(
        version=version,
        kind=kind,
        dtype=dtype,
        tensors=entries,
        chunks=[entry for entry, _ in pieces],
        payload_bytes=len(payload),
        state_sha256=state_sha256,
        **links,
    )
    if staging is not None:
        sections = build_sections(manifest, staging.stage_map, staging.state_sha256, staging.base_sha256)
        manifest = manifest.model_copy(update={"stage_map": staging.stage_map, "stages": sections})
    return manifest, pieces


class Publisher:
    def __init__(
        self,
        client: CoordinatorClient,
        config: WeightsConfig,
        key_path: Path,
        stage_map: StageMap | None = None,
        stage: int | None = None,
        chunks: ChunkStore | None = None,
    ):
        """`stage_map`: the run's pipeline stages (`ServerInfo.stage_map`); None when not staged.
        `stage`: this is that stage's trainer (its state holds that stage only). `chunks`: keep
        the chunks there instead of uploading them (`weights.store = "peers"`)."""
        self.client = client
        self.config = config
        self.stage = stage
        self.own_stage_map = stage_map if stage is not None else None
        """A stage trainer's: named by each manifest, which then has no sections."""
        self.stage_map = stage_map if stage is None else None
        self.chunks = chunks
        self.key = load_or_create_key(key_path)
        self.public_key = public_key_hex(self.key)
        self.previous: tuple[int, dict[str, torch.Tensor], str, list[str] | None] | None = None
        """(version, published state, its hash, its hash per stage) of the last version."""
        self.history: list[Published] = []
        self.anchors: list[Anchor] = []
        """Oldest first: the base (while its patches pay), then the newest snapshot."""
        self.catch_up = True
        """Publish catch-up patches (off while nobody follows the weights: `trainer/publication.py`)."""
        self._told_skip = False

    def register(self) -> None:
        self.client.register_trainer_key(TrainerKey(public_key=self.public_key, stage=self.stage))
        whose = "trainer" if self.stage is None else f"stage {self.stage} trainer"
        log.info("%s public key %s (pin it with worker.trainer_public_key)", whose, self.public_key)

    def publish(self, model: torch.nn.Module, version: int) -> list[Published]:
        """Publish `version` from the model's current weights; idempotent for an already published one."""
        return self.publish_state(state_for_publication(model), version)

    def publish_state(
        self,
        state: dict[str, torch.Tensor],
        version: int,
        snapshot: bool = False,
        registered: Callable[[], None] | None = None,
    ) -> list[Published]:
        """Publish `version`: a delta against the previous one, and a snapshot every
        `snapshot_every` versions, without a previous state, or when asked (`snapshot`); and,
        while `catch_up` (someone follows the weights), catch-up patches. `registered` is called
        once the coordinator holds the version (its first manifest is stored), before the rest
        (a snapshot after the delta, the patches) goes up."""
        state = published_state(state, self.config.dtype)
        digest = state_hash(state)
        stage_digests = stage_hashes(state, self.stage_map)
        kinds: list[Kind] = []
        previous = self.previous
        continues = previous is not None and previous[0] == version - 1
        if continues:
            kinds.append("delta")
        if snapshot or version % self.config.snapshot_every == 0 or not kinds:
            kinds.append("snapshot")
        done = []
        for kind in kinds:
            done.append(self._publish_one(version, kind, state, digest, stage_digests))
            if registered is not None and len(done) == 1:
                registered()
        if previous is not None and continues:
            self._grow_unions(previous[1], state)
        else:
            self.anchors = []  # a new base: the unions since older versions are unknown
        if "snapshot" in kinds:
            self._add_anchor(version, digest, stage_digests, done[-1].payload_bytes, base=not continues)
        elif self.catch_up:
            done += self._publish_patches(version, state, digest, stage_digests)
        self.previous = (version, state, digest, stage_digests)
        self.history.extend(done)
        for published in done:
            log.info(
                "published v%d %s%s (%d bytes%s, %s, encoded in %.2fs)",
                published.version,
                published.kind,
                "" if published.anchor is None else f" against anchor v{published.anchor}",
                published.payload_bytes,
                "" if published.stage_bytes is None else f"; per stage {published.stage_bytes}",
                published.encodings,
                published.encode_seconds,
            )
        return done

    def delta_ratio(self, done: list[Published]) -> float | None:
        """What a worker one version behind downloads for the version just published (its delta),
        over the version's size as published; None when it went out as a snapshot only."""
        deltas = [published.payload_bytes for published in done if published.kind == "delta"]
        if not deltas or self.previous is None:
            return None
        return deltas[0] / sum(t.numel() * t.element_size() for t in self.previous[1].values())

    def _publish_one(
        self, version: int, kind: Kind, state: dict, digest: str, stage_digests: list[str] | None
    ) -> Published:
        started = time.perf_counter()
        previous = self.previous if kind == "delta" else None
        old, old_sha = (previous[1], previous[2]) if previous is not None else (None, None)
        staging = self._staging(stage_digests, None if previous is None else previous[3])
        manifest, pieces = build_manifest(
            version, old, state, self.config.dtype, self.config.chunk_bytes, digest, old_sha, staging
        )
        return self._upload(manifest, pieces, time.perf_counter() - started)

    def _upload(self, manifest: Manifest, pieces: list, encode_seconds: float) -> Published:
        for entry, data in pieces:
            if self.chunks is not None:
                self.chunks.put(entry.sha256, data)
            else:
                self.client.upload_chunk(entry.sha256, data)
        if self.stage is not None:
            manifest = manifest.model_copy(update={"stage_map": self.own_stage_map, "stage": self.stage})
        signed = sign(manifest, self.key)
        body = signed.model_dump_json().encode()
        self.client.upload_manifest(manifest.version, manifest.kind, body, manifest.anchor, self.stage)
        counts: dict[str, int] = {}
        for tensor in manifest.tensors:
            counts[tensor.encoding] = counts.get(tensor.encoding, 0) + 1
        return Published(
            manifest.version,
            manifest.kind,
            manifest.payload_bytes,
            manifest.state_sha256,
            encode_seconds,
            counts,
            manifest.anchor,
            stage_bytes(manifest),
            [chunk.sha256 for chunk in manifest.chunks],
        )

    def _staging(self, stage_digests: list[str] | None, base: list[str] | None) -> Staging | None:
        if self.stage_map is None:
            return None
        assert stage_digests is not None
        return Staging(self.stage_map, stage_digests, base)

    # ------------------------------------------------------------------ catch-up patches

    def _add_anchor(
        self, version: int, digest: str, stage_digests: list[str] | None, snapshot_bytes: int, base: bool
    ) -> None:
        """The newest snapshot becomes an anchor, replacing the previous snapshot's but not the base."""
        if self.config.patch_max_fraction == 0:
            return
        kept = [] if base else [anchor for anchor in self.anchors if anchor.base]
        self.anchors = [*kept, Anchor(version, digest, snapshot_bytes, {}, base, stage_digests)]

    def _grow_unions(self, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
        if not self.anchors:
            return
        for name, tensor in new.items():
            changed = changed_mask(old[name], tensor)
            if not changed.any():
                continue
            for anchor in self.anchors:
                if name in anchor.union:
                    anchor.union[name] |= changed
                else:
                    anchor.union[name] = changed.clone()

    def _publish_patches(
        self, version: int, state: dict, digest: str, stage_digests: list[str] | None
    ) -> list[Published]:
        """One patch per anchor at least two versions back (at one, the delta is the same edge),
        while it pays; each is encoded once."""
        done: list[Published] = []
        for anchor in [a for a in self.anchors if version - a.version >= 2]:
            started = time.perf_counter()
            staging = self._staging(stage_digests, anchor.stage_sha256)
            manifest, pieces = build_patch(
                version, state, anchor, self.config.dtype, self.config.chunk_bytes, digest, staging
            )
            limit = self.config.patch_max_fraction * anchor.snapshot_bytes
            if manifest.payload_bytes >= limit:
                self._drop(anchor, version, manifest.payload_bytes)
            elif done and manifest.payload_bytes >= NEWER_ANCHOR_GAIN * done[-1].payload_bytes:
                continue  # barely smaller than the older anchor's patch, which serves more versions
            else:
                done.append(self._upload(manifest, pieces, time.perf_counter() - started))
        return done

    def _drop(self, anchor: Anchor, version: int, payload_bytes: int) -> None:
        """Its union only grows, so its patches will not pay again."""
        self.anchors.remove(anchor)
        level = logging.DEBUG if self._told_skip else logging.INFO
        self._told_skip = True
        log.log(
            level,
            "no more catch-up patches against v%d from v%d: %d bytes, over weights.patch_max_fraction "
            "(%.2f) of its snapshot (%d bytes); catch-up takes deltas and snapshots instead",
            anchor.version,
            version,
            payload_bytes,
            self.config.patch_max_fraction,
            anchor.snapshot_bytes,
        )
