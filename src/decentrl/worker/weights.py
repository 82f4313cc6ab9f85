"""The worker's weights: follow the latest published version by the cheapest verified route.

The worker learns the latest version with each lease; when behind, it plans and fetches a route
(`weights.sync.WeightSync`), verifies it and merges what changed (`fetch`, which may run in a
background thread while the engine generates), then copies only the changed tensors into the
engine's live weights, in place and atomically with respect to generation (`apply`). Chunks it
holds stay in `state_dir/chunks` (a restart resumes from them) and, with `serve_peers`, are served
to other workers; it announces its chunk server and version to the coordinator after every version
(the answer is the peer list the next fetch uses).

A pipeline stage holder (`stage`) follows only its stage of a staged run: its sync fetches, decodes
and verifies that stage's sections alone, its chunk store (and so what it serves peers) holds only
that stage's chunks, and the engine is given only that stage's tensors: the whole stage
(`load_weights`) after a route that opened with a snapshot, else the tensors that changed.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from decentrl.client import CoordinatorClient, RequestRejected
from decentrl.config import WorkerConfig
from decentrl.engines.base import WeightsTarget
from decentrl.model import lora
from decentrl.protocol import PeerAnnounce, ServerInfo, WeightsInfo, WeightsReceived
from decentrl.weights.chunks import ChunkStore
from decentrl.weights.peer_server import PeerServer
from decentrl.weights.planner import NoRoute
from decentrl.weights.sections import part
from decentrl.weights.signing import parse_public_key
from decentrl.weights.sync import VerificationFailed, WeightSync
from decentrl.weights.transfer import COORDINATOR, ChunkFetcher

log = logging.getLogger(__name__)

IDLE_MIN_SECONDS = 0.05
NO_WEIGHTS_MAX_SECONDS = 2.0
KEEP_ROUTES = 2
"""Chunks of the manifests of this many most recent syncs stay on disk (and servable)."""


@dataclass
class Loaded:
    """A verified version, fetched (LoRA adapters merged for an engine that cannot serve them), waiting to be copied into the engine."""

    version: int
    tensors: dict[str, torch.Tensor]
    whole: bool = False
    """A stage holder's route opened with a snapshot: `tensors` is its whole stage."""


class WeightsRefused(RuntimeError):
    """The run's weights cannot be trusted by this worker (its pinned key differs); exit code 2."""


class WorkerWeights:
    def __init__(
        self,
        client: CoordinatorClient,
        engine: WeightsTarget,
        config: WorkerConfig,
        state_dir: Path,
        stage: int | None = None,
    ):
        """`stage`: follow only this pipeline stage of a staged run (None: the whole model)."""
        self.client = client
        self.engine = engine
        self.config = config
        self.stage = stage
        self.fetcher = ChunkFetcher(client, ChunkStore(state_dir / "chunks"))
        self.sync: WeightSync | None = None
        self.server: PeerServer | None = None
        if config.serve_peers:
            self.server = PeerServer(
                self.fetcher.store, config.peer_host, config.peer_port, config.upload_bytes_per_second
            ).start()
            log.info("serving weight chunks to peers at %s", self.url)
        self._refused = False
        """The coordinator refused this worker's chunk server address: it announces no more."""
        self._recent: list[set[str]] = []
        self._wait = IDLE_MIN_SECONDS
        self.received: WeightsReceived | None = None
        """Bytes of the last update by source, until the next lease request carries them."""

    @property
    def url(self) -> str | None:
        return None if self.server is None else self.config.peer_url or self.server.url

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.fetcher.close()

    def _trainer_key(self, info: ServerInfo):
        """The key this worker's manifests are signed with: the trainer's, or in a run of stage
        trainers its own stage's (`info.stage_keys`)."""
        offered = info.trainer_public_key
        if info.stage_keys is not None and self.stage is not None and self.stage < len(info.stage_keys):
            offered = info.stage_keys[self.stage]
        pinned = self.config.trainer_public_key
        if pinned is not None and offered is not None and pinned.lower() != offered:
            raise WeightsRefused(
                f"the coordinator hands out trainer key {offered[:16]}..., not the pinned "
                f"worker.trainer_public_key {pinned[:16]}...; check which run this worker joins"
            )
        key = pinned or offered
        return None if key is None else parse_public_key(key)

    def refresh_peers(self) -> None:
        """Announce this worker's chunk server (if any) and take the current peer list."""
        if self.url is not None and not self._refused:
            version = -1 if self.sync is None or self.sync.version is None else self.sync.version
            try:
                self.fetcher.peers = self.client.announce_peer(PeerAnnounce(url=self.url, version=version))
                return
            except RequestRejected as exc:
                if exc.status != 422:
                    raise
                # An address the coordinator will not send others to (a private one it does not
                # list): this worker still downloads from peers, it only stops offering.
                log.warning(
                    "the coordinator refuses this worker's chunk server (%s); serving no peers. Set "
                    "worker.peer_url to a reachable address, or weights.peer_networks on the coordinator",
                    exc.detail,
                )
                self._refused = True
        self.fetcher.peers = self.client.peers()

    def follow(self, stop: threading.Event, latest: WeightsInfo | None = None) -> bool:
        """Be at the latest version (`latest`: as just asked in the background, else asked now);
        False (after a short wait) while none can be loaded yet."""
        latest = latest or self.client.latest_weights()
        if latest is None or (self.sync is None and not self._start()):
            self._idle(stop, "no weights published yet")
            return False
        if latest.version == self.engine.policy_version:
            self._wait = IDLE_MIN_SECONDS
            return True
        loaded = self.fetch(latest)
        if loaded is None:
            self._idle(stop, f"cannot reach v{latest.version} yet")
            return False
        self.apply(loaded)
        return True

    def fetch(self, latest: WeightsInfo) -> Loaded | None:
        """Fetch, verify and decode `latest` into the mirror, and pick what changed as the
        tensors the engine takes; None when it cannot be reached yet. It touches only the mirror,
        the chunk store and the network, never the engine, so it may run while the engine
        generates (in a background thread, one fetch at a time, applied between generations)."""
        if self.sync is None and not self._start():
            return None
        sync = self.sync
        assert sync is not None  # _start() made it
        started = time.perf_counter()
        received = sum(self.fetcher.bytes_from.values())
        from_coordinator = self.fetcher.bytes_from[COORDINATOR]
        if sync.version is None:  # nothing held yet: announce first to learn the peers
            self.refresh_peers()
        try:
            changed = sync.sync_to(latest.version)
        except (NoRoute, VerificationFailed) as exc:
            log.info("cannot reach v%d yet: %s", latest.version, exc)
            # The sources may have moved (a restarted stage trainer serves its chunks at a new
            # address): the next attempt asks the peers the coordinator lists now.
            self.refresh_peers()
            return None
        held, _, route = sync.routes[-1]
        # A stage holder's engine restarts from a whole stage (it keeps a window of versions).
        whole = self.stage is not None and route.steps[0][1] == "snapshot"
        names = list(sync.state) if whole else changed
        # LoRA adapters reach an engine that serves them as published; any other engine gets
        # W0 + B @ A of the layers they touch.
        if self.engine.serves_adapters:
            tensors = {name: sync.state[name] for name in names}
        else:
            tensors = lora.merge(sync.state, names)
        self._keep_recent(route.steps)
        # The announcement carries the version now served, and brings the peers for the next fetch.
        self.refresh_peers()
        downloaded = sum(self.fetcher.bytes_from.values()) - received
        from_peers = downloaded - (self.fetcher.bytes_from[COORDINATOR] - from_coordinator)
        log.info(
            "loaded weights v%d from v%s via %s (%d tensors changed, %.1f kB downloaded, %.1f kB of it "
            "from peers, %.2fs)",
            latest.version,
            held,
            route.description,
            len(changed),
            downloaded / 1e3,
            from_peers / 1e3,
            time.perf_counter() - started,
        )
        self.received = WeightsReceived(
            version=latest.version, coordinator_bytes=downloaded - from_peers, peer_bytes=from_peers
        )
        return Loaded(latest.version, tensors, whole)

    def apply(self, loaded: Loaded) -> None:
        """Copy a fetched version into the engine (between generations)."""
        if loaded.whole:
            self.engine.load_weights(loaded.tensors, loaded.version)
        else:
            self.engine.update_weights(loaded.tensors, loaded.version)
        self._wait = IDLE_MIN_SECONDS

    def take_received(self) -> WeightsReceived | None:
        """The last update's traffic, once (it rides on the next lease request)."""
        received, self.received = self.received, None
        return received

    def _start(self) -> bool:
        info = self.client.info()
        key = self._trainer_key(info)
        if key is None:
            return False
        if self.stage is not None and (info.stage_map is None or self.stage >= info.stage_map.num_stages):
            stages = "not staged" if info.stage_map is None else f"staged as {info.stage_map.describe()}"
            raise WeightsRefused(f"this worker holds stage {self.stage}, but the run is {stages}")
        self.sync = WeightSync(
            self.client,
            key,
            self.fetcher,
            self.config.snapshot_demand_ratio,
            self.stage,
            info.stage_map if self.stage is not None else None,
            stage_signed=info.stage_keys is not None,
        )
        return True

    def _idle(self, stop: threading.Event, why: str) -> None:
        level = logging.INFO if self._wait == IDLE_MIN_SECONDS else logging.DEBUG
        log.log(level, "%s; waiting", why)
        stop.wait(self._wait)
        self._wait = min(NO_WEIGHTS_MAX_SECONDS, 2 * self._wait)

    def _keep_recent(self, steps: list[tuple[int, str]]) -> None:
        """Drop chunks no recent route used, so the cache stays about one version's size."""
        digests = set()
        seen = self.sync.manifests_seen if self.sync is not None else {}
        for version, kind in steps:
            manifest = seen.get((version, kind))
            if manifest is not None:
                digests.update(chunk.sha256 for chunk in part(manifest, self.stage).chunks)
        self._recent = [*self._recent[-(KEEP_ROUTES - 1) :], digests]
        keep = set().union(*self._recent)
        for digest in self.fetcher.store.digests() - keep:
            self.fetcher.store.remove(digest)
