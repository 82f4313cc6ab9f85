"""Weights end to end against a real coordinator process: publish signed deltas and patches, catch
up by the cheapest route, and survive a forged manifest, a corrupted chunk, a truncated download and a peer
that serves garbage, each time ending at the right version with the right state hash."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from weights_support import Coordinator, FaultProxy, perturb, publish_versions, tiny_model

from decentrl.client import CoordinatorUnavailable, RequestRejected
from decentrl.config import LOOPBACK_NETWORKS
from decentrl.protocol import PeerInfo
from decentrl.weights.chunks import ChunkStore
from decentrl.weights.codec import state_hash
from decentrl.weights.manifest import Manifest
from decentrl.weights.peer_server import PeerServer
from decentrl.weights.planner import plan
from decentrl.weights.publisher import Publisher
from decentrl.weights.signing import load_or_create_key, parse_public_key, sign
from decentrl.weights.sync import WeightSync
from decentrl.weights.transfer import ChunkFetcher
from decentrl.weights.unique_storage import state_for_publication

pytestmark = pytest.mark.integration
CHUNK = 8192


def start_system(tmp_path: Path, patch_max_fraction: float):
    model = tiny_model(tmp_path / "model")
    coordinator = Coordinator(
        tmp_path,
        tmp_path / "model",
        snapshot_every=10,
        chunk_bytes=CHUNK,
        patch_max_fraction=patch_max_fraction,
        peer_networks=LOOPBACK_NETWORKS,
    )
    publisher = Publisher(coordinator.trainer, coordinator.run.weights, tmp_path / "trainer" / "key.pem")
    publisher.register()
    return coordinator, publisher, model


@pytest.fixture
def system(tmp_path: Path):
    """Deltas and snapshots only: the transfer faults below are about those routes."""
    coordinator, publisher, model = start_system(tmp_path, patch_max_fraction=0.0)
    yield coordinator, publisher, model
    coordinator.stop()


@pytest.fixture
def patched(tmp_path: Path):
    """With catch-up patches, as configured by default."""
    coordinator, publisher, model = start_system(tmp_path, patch_max_fraction=0.5)
    yield coordinator, publisher, model
    coordinator.stop()


def worker_sync(coordinator: Coordinator, publisher: Publisher, root: Path, url: str | None = None, **client):
    http = coordinator.worker_client(root, url, max_wait=client.pop("max_wait", 30), **client)
    fetcher = ChunkFetcher(http, ChunkStore(root / "chunks"), seed=0)
    return WeightSync(http, parse_public_key(publisher.public_key), fetcher)


def expected_hash(publisher: Publisher, version: int) -> str:
    return next(p.state_sha256 for p in publisher.history if p.version == version)


@pytest.mark.slow  # CI time: `make test-all` runs it
def test_offline_worker_catches_up_by_the_cheapest_route(system, tmp_path) -> None:
    coordinator, publisher, model = system
    publish_versions(publisher, model, range(0, 4), fraction=0.002)
    sync = worker_sync(coordinator, publisher, tmp_path / "w1")
    sync.sync_to(3)
    assert sync.routes[-1][2].steps == [(0, "snapshot"), (1, "delta"), (2, "delta"), (3, "delta")]
    # Offline for 20 versions of small deltas: the chain (20 small deltas) beats snapshot 20 + 3 deltas.
    publish_versions(publisher, model, range(4, 24), fraction=0.002)
    index = sync.client.weights_index()
    before = sum(sync.fetcher.bytes_from.values())
    sync.sync_to(23)
    route = sync.routes[-1][2]
    assert route.steps == [(v, "delta") for v in range(4, 24)]
    assert route.num_bytes < plan(None, 23, index).num_bytes  # the snapshot route was dearer
    assert sum(sync.fetcher.bytes_from.values()) - before == route.num_bytes  # and exactly this was fetched
    assert state_hash(sync.state) == expected_hash(publisher, 23)
    # Ten versions that each move every element: now snapshot 30 + 3 deltas is cheaper.
    publish_versions(publisher, model, range(24, 34), fraction=1.0)
    sync.sync_to(33)
    route = sync.routes[-1][2]
    assert route.steps == [(30, "snapshot"), (31, "delta"), (32, "delta"), (33, "delta")]
    deltas_only = [e for e in sync.client.weights_index() if e.kind == "delta"]
    assert route.num_bytes < plan(23, 33, deltas_only).num_bytes
    assert state_hash(sync.state) == expected_hash(publisher, 33)


@pytest.mark.slow  # 14 s; the cheapest-route test above runs in CI
def test_offline_worker_catches_up_by_one_patch_when_few_elements_move(patched, tmp_path, caplog) -> None:
    coordinator, publisher, model = patched
    proxy = FaultProxy(coordinator.url)
    try:
        # Only one tensor moves, as with LoRA adapters: the run's base anchors every patch.
        publish_versions(publisher, model, range(0, 4), fraction=1.0, only="down_proj")
        sync = worker_sync(coordinator, publisher, tmp_path / "w1")
        sync.sync_to(3)
        assert sync.routes[-1][2].description == "snapshot v0 + patch v3 (anchor v0)"
        other = worker_sync(coordinator, publisher, tmp_path / "w2", url=proxy.url)
        other.sync_to(3)
        # Offline for 20 versions: one patch beats the 20-delta chain and snapshot 20 + 3 deltas.
        publish_versions(publisher, model, range(4, 24), fraction=1.0, only="down_proj")
        index = sync.client.weights_index()
        before = sum(sync.fetcher.bytes_from.values())
        sync.sync_to(23)
        route = sync.routes[-1][2]
        assert route.description == "patch v23 (anchor v0)"
        without_patches = plan(3, 23, [e for e in index if e.kind != "patch"])
        assert 3 * route.num_bytes < without_patches.num_bytes
        assert sum(sync.fetcher.bytes_from.values()) - before == route.num_bytes
        assert state_hash(sync.state) == expected_hash(publisher, 23)

        # A forged patch is refused and routed around (here: patch v22 + delta v23).
        real = Manifest.model_validate_json(coordinator.trainer.manifest_bytes(23, "patch", 0))
        attacker = load_or_create_key(tmp_path / "attacker.pem")
        forged = sign(real, attacker).model_dump_json().encode()
        proxy.rules.append(lambda path, body: forged if "/manifests/23/patch" in path else body)
        other.sync_to(23)
        assert other.rejected_manifests == 1
        assert other.routes[-1][2].description == "patch v22 (anchor v0) + 1 deltas"
        assert state_hash(other.state) == expected_hash(publisher, 23)
        # The coordinator takes no mis-signed patch, none before its version, none off its history.
        with pytest.raises(RequestRejected) as refused:
            coordinator.trainer.upload_manifest(23, "patch", forged, 0)
        assert refused.value.status == 422
        early = sign(real.model_copy(update={"version": 24}), publisher.key).model_dump_json().encode()
        with pytest.raises(RequestRejected, match="before its patches"):
            coordinator.trainer.upload_manifest(24, "patch", early, 0)
        elsewhere = real.model_copy(update={"anchor": 5, "anchor_state_sha256": "e" * 64})
        body = sign(elsewhere, publisher.key).model_dump_json().encode()
        with pytest.raises(RequestRejected, match="never published"):
            coordinator.trainer.upload_manifest(23, "patch", body, 5)

        # Every element moves: patches stop paying, which is logged once, and snapshots take over.
        with caplog.at_level(logging.DEBUG, logger="decentrl.weights.publisher"):
            publish_versions(publisher, model, range(24, 34), fraction=1.0)
        skipped = [r for r in caplog.records if "no more catch-up patches" in r.getMessage()]
        assert len(skipped) == 3 and [r.levelno for r in skipped].count(logging.INFO) == 1
        assert not [e for e in sync.client.weights_index() if e.kind == "patch" and e.version > 23]
        sync.sync_to(33)
        assert sync.routes[-1][2].description == "snapshot v30 + 3 deltas"
        assert state_hash(sync.state) == expected_hash(publisher, 33)
    finally:
        proxy.stop()


def test_no_patches_while_nobody_follows_and_the_first_one_after_covers_the_gap(patched, tmp_path) -> None:
    """`catch_up` off (the coordinator saw no worker lately): deltas only, while the anchors' masks
    still grow, so the first patch after catch-up resumes turns the anchor into the new version."""
    coordinator, publisher, model = patched
    publish_versions(publisher, model, range(0, 3), fraction=1.0, only="down_proj")
    publisher.catch_up = False
    publish_versions(publisher, model, range(3, 8), fraction=1.0, only="down_proj")
    sync = worker_sync(coordinator, publisher, tmp_path / "w1")
    patches = lambda: [e.version for e in sync.client.weights_index() if e.kind == "patch"]  # noqa: E731
    assert patches() == [2]
    assert {(e.version, e.kind) for e in sync.client.weights_index()} >= {(v, "delta") for v in range(1, 8)}
    sync.sync_to(7)  # a worker that arrives meanwhile follows the deltas
    assert sync.routes[-1][2].description == "snapshot v0 + patch v2 (anchor v0) + 5 deltas"
    assert state_hash(sync.state) == expected_hash(publisher, 7)
    publisher.catch_up = True
    perturb(model, 1.0, seed=8, only="down_proj")
    held_when_told: list[tuple[int, str]] = []  # what the index held when the callback came

    def registered() -> None:
        held_when_told.extend((e.version, e.kind) for e in sync.client.weights_index() if e.version == 8)

    publisher.publish_state(state_for_publication(model), 8, registered=registered)
    assert held_when_told == [(8, "delta")]  # held (its delta is up), the patch not yet
    assert patches() == [2, 8]
    late = worker_sync(coordinator, publisher, tmp_path / "w2")
    late.sync_to(8)
    assert late.routes[-1][2].description == "snapshot v0 + patch v8 (anchor v0)"
    assert state_hash(late.state) == expected_hash(publisher, 8)


def test_forged_manifest_and_corrupted_chunk_are_detected_and_routed_around(system, tmp_path) -> None:
    coordinator, publisher, model = system
    publish_versions(publisher, model, range(0, 6), fraction=0.01)
    proxy = FaultProxy(coordinator.url)
    try:
        sync = worker_sync(coordinator, publisher, tmp_path / "w1", url=proxy.url)
        sync.sync_to(5)
        publish_versions(publisher, model, range(6, 23), fraction=0.01)
        # A man in the middle swaps delta 7 for one signed by another key: the chain from 5 is
        # poisoned, so the worker must notice and come round by a snapshot.
        attacker = load_or_create_key(tmp_path / "attacker.pem")
        real = Manifest.model_validate_json(coordinator.trainer.manifest_bytes(7, "delta"))
        forged = sign(real.model_copy(update={"state_sha256": "f" * 64}), attacker).model_dump_json().encode()
        proxy.rules.append(lambda path, body: forged if path.endswith("/manifests/7/delta") else body)
        sync.sync_to(22)
        assert sync.rejected_manifests == 1
        assert sync.routes[-1][2].steps[0][1] == "snapshot"
        assert sync.version == 22 and state_hash(sync.state) == expected_hash(publisher, 22)

        # Another worker starting from nothing; every copy of one chunk of snapshot 20 has a flipped bit.
        fresh = worker_sync(coordinator, publisher, tmp_path / "w2", url=proxy.url)
        snapshot = Manifest.model_validate_json(coordinator.trainer.manifest_bytes(20, "snapshot"))
        bad = snapshot.chunks[1].sha256
        proxy.rules.append(lambda path, body: bytes([body[0] ^ 1]) + body[1:] if path.endswith(bad) else body)
        fresh.sync_to(22)
        assert fresh.fetcher.rejected_from["coordinator"] == 1 and not fresh.store.has(bad)
        assert fresh.routes[-1][2].steps[0] == (10, "snapshot")  # the next cheapest route
        assert fresh.version == 22 and state_hash(fresh.state) == expected_hash(publisher, 22)
    finally:
        proxy.stop()


def test_truncated_download_resumes_from_the_last_verified_chunk(system, tmp_path) -> None:
    coordinator, publisher, model = system
    publish_versions(publisher, model, range(0, 3), fraction=0.01)
    proxy = FaultProxy(coordinator.url)
    try:
        # Every chunk answer is cut in half after the first five chunks: the download fails...
        served: list[str] = []

        def cut_after_five(path: str, body: bytes) -> bytes | None:
            if "/weights/chunks/" not in path:
                return body
            served.append(path)
            return body if len(served) <= 5 else None

        proxy.rules.append(cut_after_five)
        broken = worker_sync(
            coordinator, publisher, tmp_path / "w1", url=proxy.url, max_wait=1.0, base_delay=0.05
        )
        with pytest.raises(CoordinatorUnavailable):
            broken.sync_to(2)
        assert broken.version is None and broken.state == {}
        held = ChunkStore(tmp_path / "w1" / "chunks").digests()
        assert len(held) == 5  # the five verified chunks, no partial file
        # ... and a restart on the same chunk store fetches only what is missing.
        proxy.rules.clear()
        before = proxy.chunk_requests()
        again = worker_sync(coordinator, publisher, tmp_path / "w1", url=proxy.url)
        again.sync_to(2)
        fetched = proxy.chunk_requests() - before
        assert not {path.rsplit("/", 1)[1] for path in fetched} & held
        assert (
            sum(fetched.values())
            == len({c.sha256 for m in again.manifests_seen.values() for c in m.chunks}) - 5
        )
        assert state_hash(again.state) == expected_hash(publisher, 2)
        # A single cut answer is retried by the client and costs one chunk, not the download.
        publish_versions(publisher, model, range(3, 4), fraction=0.5)
        once = []
        proxy.rules.append(
            lambda path, body: None if "/chunks/" in path and not once and not once.append(1) else body
        )
        again.sync_to(3)
        assert once and state_hash(again.state) == expected_hash(publisher, 3)
    finally:
        proxy.stop()


class GarbagePeer(PeerServer):
    """Claims to hold every chunk of an honest store and serves garbage for each."""

    def __init__(self, honest: ChunkStore, own: ChunkStore):
        super().__init__(own)
        self.honest = honest

    def held_digests(self) -> set[str]:
        return self.honest.digests()

    def chunk_bytes(self, digest: str) -> bytes | None:
        return b"garbage" * 100


def test_peer_serving_garbage_is_detected_reported_and_bypassed(system, tmp_path) -> None:
    coordinator, publisher, model = system
    publish_versions(publisher, model, range(0, 3), fraction=0.01)
    good = worker_sync(coordinator, publisher, tmp_path / "good")
    good.sync_to(2)
    honest = PeerServer(good.store).start()
    liar = GarbagePeer(good.store, ChunkStore(tmp_path / "liar")).start()
    try:
        liar_client = coordinator.worker_client(tmp_path / "liar-id")
        from decentrl.protocol import PeerAnnounce

        liar_client.announce_peer(PeerAnnounce(url=liar.url, version=2))
        liar_id = next(p.worker_id for p in good.client.peers() if p.url == liar.url)
        sync = worker_sync(coordinator, publisher, tmp_path / "w1")
        sync.fetcher.peers = [PeerInfo(worker_id=liar_id, url=liar.url, version=2)]
        sync.sync_to(2)
        assert sync.fetcher.rejected_from[liar_id] == 1 and liar_id in sync.fetcher.bad_peers
        assert state_hash(sync.state) == expected_hash(publisher, 2)
        rows = coordinator_events(coordinator, "peer_misbehaved")
        assert [row[0] for row in rows] == [liar_id]
        # With an honest peer listed, chunks come from it and not from the coordinator.
        peer = worker_sync(coordinator, publisher, tmp_path / "w2")
        peer.fetcher.peers = [PeerInfo(worker_id="honest", url=honest.url, version=2)]
        peer.sync_to(2)
        assert peer.fetcher.bytes_from["honest"] > 0 and peer.fetcher.bytes_from["coordinator"] == 0
        assert state_hash(peer.state) == expected_hash(publisher, 2)
        liar_client.close()
    finally:
        honest.stop()
        liar.stop()


def coordinator_events(coordinator: Coordinator, kind: str) -> list[tuple]:
    import sqlite3

    with sqlite3.connect(coordinator.run_dir / "coordinator.db") as db:
        return db.execute("SELECT worker_id, reason FROM events WHERE kind = ?", (kind,)).fetchall()


def test_a_dear_route_asks_for_a_snapshot_and_the_next_joiner_gets_one(system, tmp_path, caplog) -> None:
    """Big deltas make snapshot 0 + 7 deltas cost several snapshots: the worker takes that route
    but asks for a snapshot; the trainer's next version comes with one, and a worker joining then
    needs that snapshot alone."""
    coordinator, publisher, model = system
    publish_versions(publisher, model, range(0, 8), fraction=0.5)
    first = worker_sync(coordinator, publisher, tmp_path / "w1")
    first.snapshot_demand_ratio = 2.0
    with caplog.at_level(logging.INFO, logger="decentrl.weights.sync"):
        first.sync_to(7)
    assert first.routes[-1][2].steps[0] == (0, "snapshot") and len(first.routes[-1][2].steps) == 8
    assert "asked for a fresh one (pending)" in caplog.text
    assert coordinator.trainer.request_snapshot() == {"pending": True, "snapshot": 0, "next_at": 8}

    perturb(model, 0.5, seed=8)  # the trainer's next version, published with a snapshot as asked
    kinds = [done.kind for done in publisher.publish_state(state_for_publication(model), 8, snapshot=True)]
    assert kinds == ["delta", "snapshot"]
    assert coordinator.trainer.request_snapshot() == {"pending": False, "snapshot": 8, "next_at": None}
    second = worker_sync(coordinator, publisher, tmp_path / "w2")
    second.snapshot_demand_ratio = 2.0
    second.sync_to(8)
    assert second.routes[-1][2].steps == [(8, "snapshot")]
    assert second.state_sha256 == expected_hash(publisher, 8)
