"""Hostile peers against a worker's chunk fetcher, and hostile clients against a worker's chunk
server, with a real coordinator process: a peer that trickles or floods costs a deadline or one
chunk's bytes, is dropped, and the weights still arrive (from the coordinator) bit-exact."""

from __future__ import annotations

import socket
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from weights_support import Coordinator, publish_versions, tiny_model

from benchmarks.adversarial.peers import HostilePeer, Misbehaviour
from decentrl.config import LOOPBACK_NETWORKS
from decentrl.protocol import PeerAnnounce, PeerInfo
from decentrl.weights import peer_server as peer_module
from decentrl.weights.chunks import ChunkStore
from decentrl.weights.codec import state_hash
from decentrl.weights.peer_server import PeerServer
from decentrl.weights.publisher import Publisher
from decentrl.weights.signing import parse_public_key
from decentrl.weights.sync import WeightSync
from decentrl.weights.transfer import ChunkFetcher

pytestmark = pytest.mark.integration
CHUNK = 8192
VERSIONS = 3


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory):
    """A coordinator with three published versions (8 kB chunks) and the digests of all of them."""
    root = tmp_path_factory.mktemp("peers")
    model = tiny_model(root / "model")
    coordinator = Coordinator(
        root,
        root / "model",
        snapshot_every=10,
        chunk_bytes=CHUNK,
        patch_max_fraction=0.0,
        peer_networks=LOOPBACK_NETWORKS,
    )
    publisher = Publisher(coordinator.trainer, coordinator.run.weights, root / "trainer" / "key.pem")
    publisher.register()
    publish_versions(publisher, model, range(VERSIONS), fraction=0.01)
    reference = syncer(coordinator, publisher, root / "reference")
    reference.sync_to(VERSIONS - 1)
    yield coordinator, publisher, reference.store.digests()
    reference.fetcher.close()
    coordinator.stop()


def syncer(coordinator: Coordinator, publisher: Publisher, root: Path) -> WeightSync:
    client = coordinator.worker_client(root, max_wait=30)
    return WeightSync(
        client, parse_public_key(publisher.public_key), ChunkFetcher(client, ChunkStore(root / "chunks"))
    )


def hostile_sync(published, root: Path, behaviour: Misbehaviour, **fetcher: float):
    """Sync a fresh worker to the latest version with one hostile peer listed (in a thread, so that
    a fetcher without bounds fails the test instead of hanging it); (seconds, sync, peer, id)."""
    coordinator, publisher, digests = published
    hostile = HostilePeer(behaviour, digests)
    hostile_client = coordinator.worker_client(root / "hostile")
    hostile_client.announce_peer(PeerAnnounce(url=hostile.url, version=VERSIONS - 1))
    peer_id = next(
        p.worker_id for p in coordinator.worker_client(root / "asker").peers() if p.url == hostile.url
    )
    sync = syncer(coordinator, publisher, root / "victim")
    for name, value in fetcher.items():
        setattr(sync.fetcher, name, value)
    sync.fetcher.peers = [
        PeerInfo(worker_id=peer_id, url=hostile.url, version=VERSIONS - 1, established=True)
    ]
    started = time.monotonic()
    thread = threading.Thread(target=sync.sync_to, args=(VERSIONS - 1,), daemon=True)
    thread.start()
    thread.join(timeout=20)
    seconds = time.monotonic() - started
    hostile.stop()
    thread.join(timeout=20)
    return seconds, sync, hostile, peer_id


def test_a_trickling_peer_costs_a_deadline_and_is_dropped(published, tmp_path: Path) -> None:
    """A peer that claims every chunk, then sends one byte every half second with no length: the
    fetcher gives up on it at its deadline (one second here), twice at most, and takes the chunks
    from the coordinator."""
    coordinator, publisher, _ = published
    seconds, sync, hostile, peer_id = hostile_sync(
        published, tmp_path, Misbehaviour.TRICKLE, peer_deadline=1.0
    )
    print(f"trickling peer: weights in {seconds:.1f}s, {hostile.requests} chunk requests to it")
    assert seconds < 10, seconds
    assert sync.version == VERSIONS - 1
    assert state_hash(sync.state) == next(
        p.state_sha256 for p in publisher.history if p.version == VERSIONS - 1
    )
    assert sync.fetcher.bytes_from[peer_id] == 0 and sync.fetcher.failed_from[peer_id] >= 1
    assert hostile.requests <= 2, hostile.requests


def test_a_flooding_peer_is_cut_off_at_the_chunk_size_and_reported(published, tmp_path: Path) -> None:
    """A peer that answers an 8 kB chunk with 200 MB: the fetcher stops reading past 8 kB (what the
    peer got into the sockets' buffers is all it sends), reports it and never asks it again."""
    coordinator, publisher, _ = published
    seconds, sync, hostile, peer_id = hostile_sync(published, tmp_path, Misbehaviour.FLOOD)
    print(f"flooding peer: {hostile.sent / 1e6:.1f} MB accepted from it in {seconds:.1f}s")
    assert hostile.sent < 16 << 20, hostile.sent
    assert hostile.requests == 1 and peer_id in sync.fetcher.bad_peers
    assert state_hash(sync.state) == next(
        p.state_sha256 for p in publisher.history if p.version == VERSIONS - 1
    )
    with sqlite3.connect(coordinator.run_dir / "coordinator.db") as db:
        reasons = db.execute(
            "SELECT reason FROM events WHERE kind = 'peer_misbehaved' AND worker_id = ?", (peer_id,)
        )
        ((reason,),) = reasons.fetchall()
    # cut at the size of the chunk it was asked for: 8 kB, or less for the last chunk of a manifest
    # (which chunk goes to the peer first depends on the fetcher's threads)
    size = int(reason.split(": ", 1)[1].removeprefix("over ").removesuffix(" bytes"))
    assert 0 < size <= CHUNK and reason.endswith(f"over {size} bytes"), reason


def test_a_chunk_server_closes_idle_connections_and_caps_them(tmp_path: Path, monkeypatch) -> None:
    """An idle connection is closed after the server's socket timeout; past `MAX_CONNECTIONS` open
    ones, a new connection is closed at once, unanswered."""
    monkeypatch.setattr(peer_module, "SOCKET_TIMEOUT_SECONDS", 0.5)
    server = PeerServer(ChunkStore(tmp_path / "chunks")).start()
    host, port = server.httpd.server_address[:2]
    sockets = [socket.create_connection((host, port), timeout=5) for _ in range(peer_module.MAX_CONNECTIONS)]
    try:
        extra = socket.create_connection((host, port), timeout=5)
        assert extra.recv(1) == b""  # closed at once: every slot is taken
        extra.close()
        started = time.monotonic()
        assert sockets[0].recv(1) == b""  # idle: closed by the server
        assert time.monotonic() - started < 4
    finally:
        for sock in sockets:
            sock.close()
        server.stop()


def test_a_worker_whose_address_is_refused_still_downloads_from_peers(tmp_path: Path, caplog) -> None:
    """A worker serving chunks on loopback, under a coordinator that lists only routable peers
    (the default): its announcement is refused, it says how to fix that, and takes peer lists
    without offering itself instead of failing."""
    from decentrl.config import WorkerConfig
    from decentrl.engines.hf import HFEngine
    from decentrl.worker.weights import WorkerWeights

    model = tiny_model(tmp_path / "model")
    coordinator = Coordinator(tmp_path, tmp_path / "model")
    weights = None
    try:
        client = coordinator.worker_client(tmp_path / "worker")
        engine = HFEngine(model, eos_token_ids=[1], pad_token_id=0, device="cpu")
        weights = WorkerWeights(client, engine, WorkerConfig(serve_peers=True), tmp_path / "worker")
        for _ in range(2):
            weights.refresh_peers()
        assert weights.fetcher.peers == []
        assert coordinator.worker_client(tmp_path / "asker").peers() == []
        refusals = [r for r in caplog.records if "refuses this worker's chunk server" in r.getMessage()]
        assert len(refusals) == 1 and "weights.peer_networks" in refusals[0].getMessage()
    finally:
        if weights is not None:
            weights.close()
        coordinator.stop()
