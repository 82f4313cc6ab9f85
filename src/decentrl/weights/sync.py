"""Reach a published version: plan the cheapest route, fetch and verify, reconstruct bit-exactly.

`WeightSync` keeps a *mirror* of the version it holds in the inference dtype (the state deltas
and patches apply to). `sync_to(target)` plans a route over the coordinator's index, fetches each
manifest and checks its signature and that the route's manifests chain (each delta names the state
hash of the one before; each patch applies to the version before it: anchor <= it < the patch's
version, and its anchor hash is the held state's when that is the anchor itself), fetches the
chunks (peers first, every byte hashed), decodes the payloads into the mirror in place and
verifies the final state hash. A manifest whose chunks no source can serve is
struck and the route re-planned. Any failure after decoding began drops the mirror, so the next
attempt starts from a snapshot: a worker never serves a state it could not verify.

With a `stage` (a pipeline stage holder of a staged run) every step reads that stage's section of
each manifest instead (`sections.part`): routes are priced by the stage's bytes, only its chunks are
fetched, only its tensors are decoded and kept, and the chain and the final state are checked with
the stage's own hashes. Its mirror never holds another stage's tensor, nor its store another
stage's chunk.

`fetch_state` is the same path for one-off use (a trusted verifier reconstructing a version).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from decentrl.client import CoordinatorClient
from decentrl.stage_map import StageMap
from decentrl.weights.chunks import ChunkStore
from decentrl.weights.codec import decode_state, state_hash
from decentrl.weights.manifest import Manifest, ManifestKey, check_layout
from decentrl.weights.planner import Route, entry_bytes, plan
from decentrl.weights.sections import part
from decentrl.weights.signing import BadSignature, verify
from decentrl.weights.transfer import ChunkFetcher, ChunkUnavailable

log = logging.getLogger(__name__)

MAX_REPLANS = 4


class VerificationFailed(RuntimeError):
    """A manifest or the reconstructed state did not verify; nothing was applied."""

    def __init__(self, message: str, manifest: ManifestKey | None = None):
        super().__init__(message)
        self.manifest = manifest
        """(version, kind, anchor) of the manifest at fault, struck from the next plan."""


class WeightSync:
    def __init__(
        self,
        client: CoordinatorClient,
        public_key: Ed25519PublicKey,
        fetcher: ChunkFetcher,
        snapshot_demand_ratio: float | None = None,
        stage: int | None = None,
        stage_map: StageMap | None = None,
        stage_signed: bool = False,
    ):
        """`stage`: hold only this pipeline stage's tensors; `stage_map`: the run's map, which every
        manifest must name (None: the first verified manifest's, kept from then on);
        `stage_signed`: the run is trained by stage trainers, so each manifest is this stage's own,
        signed by its stage trainer's key (`public_key`)."""
        if stage is not None and stage_map is not None:
            stage_map.layers(stage)  # StageMapError when the run has no such stage
        self.client = client
        self.stage = stage
        self.stage_map = stage_map
        self.stage_signed = stage_signed
        self.snapshot_demand_ratio = snapshot_demand_ratio
        """Ask for a fresh snapshot when a route costs more than this many newest snapshots."""
        self.public_key = public_key
        self.fetcher = fetcher
        self.state: dict[str, torch.Tensor] = {}
        """The mirror: every tensor, or with a stage only that stage's."""
        self.version: int | None = None
        self._state_sha256: str | None = None
        self.routes: list[tuple[int | None, int, Route]] = []
        """(from, to, route) of every sync, for logs and tests."""
        self.rejected_manifests = 0
        self.manifests_seen: dict[tuple[int, str], Manifest] = {}
        """Verified manifests of the last route."""

    @property
    def store(self) -> ChunkStore:
        return self.fetcher.store

    def sync_to(self, target: int) -> list[str]:
        """Bring the mirror to `target`; returns the names of tensors that changed."""
        struck: set[ManifestKey] = set()
        for _ in range(MAX_REPLANS):
            index = [e for e in self.client.weights_index() if (e.version, e.kind, e.anchor) not in struck]
            route = plan(self.version, target, index, self.stage)
            if not struck:
                self._maybe_ask_for_snapshot(target, route, index)
            try:
                manifests = [self._manifest((v, kind, route.anchor(v, kind))) for v, kind in route.steps]
                self._check_chain(manifests)
                self.manifests_seen = {(m.version, m.kind): m for m in manifests}
                for manifest in manifests:
                    try:
                        self.fetcher.fetch(part(manifest, self.stage).chunks)
                    except ChunkUnavailable as exc:
                        raise VerificationFailed(str(exc), manifest.key) from None
            except VerificationFailed as exc:
                log.warning("route %s to v%d failed (%s); re-planning", route.description, target, exc)
                if exc.manifest is not None:
                    struck.add(exc.manifest)
                continue
            held = self.version
            changed = self._apply(manifests)
            self.routes.append((held, target, route))
            return changed
        raise VerificationFailed(f"could not reach v{target} after {MAX_REPLANS} routes")

    def _maybe_ask_for_snapshot(self, target: int, route: Route, index: list) -> None:
        """A route dearer than `snapshot_demand_ratio` newest snapshots (a long chain once patches
        no longer pay) makes this worker ask for a snapshot with the next version, so that the next
        catch-up, its own or another worker's, is one snapshot. This route is taken all the same."""
        snapshots = [e for e in index if e.kind == "snapshot" and entry_bytes(e, self.stage) is not None]
        if self.snapshot_demand_ratio is None or not snapshots:
            return
        newest = max(snapshots, key=lambda e: e.version)
        newest_bytes = entry_bytes(newest, self.stage) or 0
        if route.num_bytes <= self.snapshot_demand_ratio * newest_bytes:
            return
        try:
            answer = self.client.request_snapshot()
        except Exception as exc:  # best effort: the route below works regardless
            log.warning("could not ask for a snapshot: %s", exc)
            return
        log.info(
            "route to v%d costs %.1fx the newest snapshot (v%d); asked for a fresh one (%s)",
            target,
            route.num_bytes / max(1, newest_bytes),
            newest.version,
            "pending" if answer.get("pending") else "already there",
        )

    def _manifest(self, key: ManifestKey) -> Manifest:
        version, kind, anchor = key
        of_stage = self.stage if self.stage_signed else None
        manifest = Manifest.model_validate_json(self.client.manifest_bytes(version, kind, anchor, of_stage))
        try:
            verify(manifest, self.public_key)
        except BadSignature as exc:
            self.rejected_manifests += 1
            raise VerificationFailed(str(exc), key) from None
        problem = check_layout(manifest) or self._stage_problem(manifest)
        if problem or manifest.key != key:
            self.rejected_manifests += 1
            raise VerificationFailed(
                f"manifest v{version} {kind}: {problem or 'answers another manifest'}", key
            )
        return manifest

    def _stage_problem(self, manifest: Manifest) -> str | None:
        """Why a stage holder cannot take this (layout-checked) manifest: no sections, another stage
        map than the run's, or no such stage."""
        if self.stage is None:
            return None
        if manifest.stage_map is None:
            return f"it is not split into stages; this holder serves stage {self.stage}"
        if self.stage_map is None:
            self.stage_map = manifest.stage_map
        if manifest.stage_map != self.stage_map:
            return f"its stage map ({manifest.stage_map.describe()}) is not the run's ({self.stage_map.describe()})"
        if self.stage >= manifest.stage_map.num_stages:
            return f"it has no stage {self.stage}"
        if manifest.stage != (self.stage if self.stage_signed else None):
            return f"it is stage {manifest.stage}'s manifest; this holder serves stage {self.stage}"
        return None

    def _check_chain(self, manifests: list[Manifest]) -> None:
        check_chain(manifests, self.version, self.state_sha256, self.stage)

    @property
    def state_sha256(self) -> str | None:
        return self._state_sha256 if self.version is not None else None

    def _apply(self, manifests: list[Manifest]) -> list[str]:
        changed: set[str] = set()
        try:
            for manifest in manifests:
                if manifest.kind == "snapshot":
                    self.state = {}
                read = part(manifest, self.stage)
                changed.update(decode_state(read.tensors, self.store.join(read.chunks), self.state))
            digest = state_hash(self.state)
            if digest != part(manifests[-1], self.stage).state_sha256:
                where = "" if self.stage is None else f" stage {self.stage}"
                raise VerificationFailed(
                    f"v{manifests[-1].version}{where}: reconstructed state hash {digest} is wrong"
                )
        except BaseException:
            self.state, self.version = {}, None  # a half-applied mirror is never used
            raise
        self.version, self._state_sha256 = manifests[-1].version, digest
        return sorted(changed)


def check_chain(
    manifests: list[Manifest], version: int | None, digest: str | None, stage: int | None = None
) -> None:
    """Each step applies to the (version, state hash) the step before it leaves, starting from the
    held `version` and `digest` (None: nothing held, so the route must open with a snapshot). With
    a `stage`, the hashes are that stage's (its sections')."""
    for manifest in manifests:
        read = part(manifest, stage)
        if manifest.kind == "delta" and (version, digest) != (manifest.parent, read.parent_state_sha256):
            raise VerificationFailed(
                f"delta v{manifest.version} does not apply to the state before it", manifest.key
            )
        if manifest.kind == "patch" and not _patch_applies(
            manifest, read.anchor_state_sha256, version, digest
        ):
            raise VerificationFailed(
                f"patch v{manifest.version} (anchor v{manifest.anchor}) does not apply to v{version}",
                manifest.key,
            )
        version, digest = manifest.version, read.state_sha256


def _patch_applies(
    patch: Manifest, anchor_sha256: str | None, version: int | None, digest: str | None
) -> bool:
    """A patch turns only a state of a version in [anchor, patch version) into its own (elements
    outside its union changed nowhere in between); below its anchor it would leave stale values."""
    assert patch.anchor is not None, "check_layout passed"
    if version is None or not patch.anchor <= version < patch.version:
        return False
    return version != patch.anchor or digest == anchor_sha256


def fetch_state(
    client: CoordinatorClient, version: int, public_key: Ed25519PublicKey, cache: Path
) -> dict[str, torch.Tensor]:
    """The verified state of `version` in the inference dtype, reconstructed by the worker's own
    fetch-verify-apply code (chunks cached content-addressed under `cache`)."""
    fetcher = ChunkFetcher(client, ChunkStore(cache, durable=False))
    try:
        sync = WeightSync(client, public_key, fetcher)
        started = time.perf_counter()
        sync.sync_to(version)
        log.info(
            "fetched v%d via %s in %.2fs",
            version,
            sync.routes[-1][2].description,
            time.perf_counter() - started,
        )
        return sync.state
    finally:
        fetcher.close()


def fetch_stages(
    client: CoordinatorClient,
    version: int,
    stage_keys: list[str | None],
    stage_map: StageMap,
    cache: Path,
    stores: list[ChunkStore] | None = None,
) -> dict[str, torch.Tensor]:
    """The verified state of `version` of a run trained by stage trainers: each stage rebuilt by a
    holder's own path (its manifests only, checked against its stage trainer's key), then put
    together; the tensor two stages hold (a tied embedding) must be the same bytes in both. This
    holds the whole model: it is what an evaluation or a release of the run does, never a role.
    `stores`: each stage trainer's own chunk store, read where it is (`weights.store = "peers"`:
    the coordinator has none); else the chunks are fetched into `cache`."""
    from decentrl.weights.signing import parse_public_key

    whole: dict[str, torch.Tensor] = {}
    for stage, key in enumerate(stage_keys):
        if key is None:
            raise VerificationFailed(f"stage {stage} has no registered key: v{version} cannot be verified")
        fetcher = ChunkFetcher(client, stores[stage] if stores else ChunkStore(cache, durable=False))
        try:
            fetcher.peers = [] if stores else client.peers()
            sync = WeightSync(
                client, parse_public_key(key), fetcher, None, stage, stage_map, stage_signed=True
            )
            sync.sync_to(version)
        finally:
            fetcher.close()
        for name, tensor in sync.state.items():
            if name in whole and not torch.equal(whole[name], tensor):
                raise VerificationFailed(f"v{version}: stages disagree on {name}, which both hold")
            whole[name] = tensor
    return whole
