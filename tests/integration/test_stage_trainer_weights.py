"""Stage trainers' weights on a real coordinator app: per-stage keys and manifests, pending
versions, and a coordinator that never holds a chunk (`weights.store = "peers"`).

The publishers are the trainer's own (`weights/publisher.py` with a stage), the holders' sync is
the workers' own (`weights/sync.py` with `stage_signed`), the coordinator is `create_app` behind
FastAPI's TestClient, and in peers mode each stage's chunks come from a real chunk server on
loopback (`weights/peer_store.py`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from decentrl.client import CoordinatorClient, RequestRejected
from decentrl.config import ModelConfig, RunConfig, TrustConfig
from decentrl.coordinator.http.app import create_app
from decentrl.model.tiny import build_tiny, save_model_dir
from decentrl.protocol import API_PREFIX, PeerInfo, TrainerKey
from decentrl.stage_map import StageMap
from decentrl.weights.chunks import ChunkStore
from decentrl.weights.codec import published_state, state_hash
from decentrl.weights.manifest import Manifest, check_layout
from decentrl.weights.peer_server import PeerServer
from decentrl.weights.peer_store import TrainerChunks
from decentrl.weights.planner import NoRoute
from decentrl.weights.publisher import Publisher
from decentrl.weights.signing import parse_public_key, sign
from decentrl.weights.sync import VerificationFailed, WeightSync
from decentrl.weights.transfer import ChunkFetcher
from decentrl.weights.unique_storage import state_for_publication

pytestmark = pytest.mark.integration

STAGES = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model_dir(*build_tiny(ModelConfig()), tmp_path_factory.mktemp("tiny-model"))


def run_config(store: str, **weights: object) -> RunConfig:
    settings = {"store": store, "chunk_bytes": 4096, "snapshot_every": 100, "peer_networks": ["127.0.0.0/8"]}
    return RunConfig.model_validate(
        {
            "model": {"num_stages": STAGES},
            "trainer": {"pipeline_stages": STAGES, "eval_every": 0},
            "weights": settings | weights,
            "trust": TrustConfig(verify_fraction=0.0).model_dump(),
        }
    )


class App:
    """A coordinator app, and clients of it that are the roles' own `CoordinatorClient`."""

    def __init__(self, config: RunConfig, run_dir: Path, model_dir: Path) -> None:
        self.config, self.run_dir, self.model_dir = config, run_dir, model_dir
        self.test_client = TestClient(create_app(config, run_dir, model_dir))
        self.test_client.__enter__()
        self.token = json.loads((run_dir / "tokens.json").read_text())["trainer_token"]

    def client(self) -> CoordinatorClient:
        client = CoordinatorClient("http://testserver", self.token, max_wait=5.0)
        client._http = TestClient(self.test_client.app, base_url=f"http://testserver{API_PREFIX}")
        return client

    def restart(self) -> None:
        self.test_client.__exit__(None, None, None)
        self.__init__(self.config, self.run_dir, self.model_dir)  # type: ignore[misc]

    def close(self) -> None:
        self.test_client.__exit__(None, None, None)


def stage_states(version: int) -> list[dict[str, torch.Tensor]]:
    """Each stage's published tensors of the tiny model, moved a little at each version."""
    model, _ = build_tiny(ModelConfig())
    state = published_state(state_for_publication(model), "bfloat16")
    generator = torch.Generator().manual_seed(version)
    for name in sorted(state):
        if version and name.endswith("mlp.up_proj.weight"):
            state[name] = (
                state[name] + (0.05 * torch.randn(state[name].shape, generator=generator)).bfloat16()
            )
    stage_map = StageMap.even(2, STAGES, tied_embeddings=True)
    return [{name: state[name] for name in stage_map.names(stage, list(state))} for stage in range(STAGES)]


def publishers(app: App, tmp_path: Path, chunk_dirs: list[Path] | None = None) -> list[Publisher]:
    info = app.client().info()
    out = []
    for stage in range(STAGES):
        chunks = ChunkStore(chunk_dirs[stage]) if chunk_dirs else None
        publisher = Publisher(
            app.client(), app.config.weights, tmp_path / f"key-{stage}.pem", info.stage_map, stage, chunks
        )
        publisher.register()
        out.append(publisher)
    return out


def holder_sync(app: App, stage: int, cache: Path) -> WeightSync:
    client = app.client()
    info = client.info()
    assert info.stage_keys is not None and info.trainer_public_key is None
    fetcher = ChunkFetcher(client, ChunkStore(cache))
    fetcher.peers = client.peers()
    key = parse_public_key(info.stage_keys[stage])  # type: ignore[arg-type]
    return WeightSync(client, key, fetcher, None, stage, info.stage_map, stage_signed=True)


def test_a_version_exists_once_every_stage_published_it_each_under_its_own_key(
    tmp_path: Path, model_dir: Path
) -> None:
    app = App(run_config("coordinator"), tmp_path / "run", model_dir)
    try:
        stage_0, stage_1 = publishers(app, tmp_path)
        states = stage_states(0)
        stage_0.publish_state(states[0], 0)
        client = app.client()
        assert client.latest_weights() is None and client.weights_index() == []  # pending
        stage_1.publish_state(states[1], 0)
        assert client.latest_weights().version == 0  # type: ignore[union-attr]
        for version in (1, 2):
            states = stage_states(version)
            stage_1.publish_state(states[1], version)  # any order
            stage_0.publish_state(states[0], version)
        latest = client.latest_weights()
        assert latest is not None and latest.version == 2
        index = client.weights_index()
        assert {entry.stage for entry in index} == {0, 1}
        # Each holder rebuilds its stage alone, under its stage trainer's key, bit for bit.
        for stage in range(STAGES):
            sync = holder_sync(app, stage, tmp_path / f"holder-{stage}")
            sync.sync_to(2)
            assert state_hash(sync.state) == state_hash(states[stage])
            assert set(sync.state) == set(states[stage])
            # Its chunk store holds only its own stage's chunks.
            own = {c for m in sync.manifests_seen.values() for c in (x.sha256 for x in m.chunks)}
            assert sync.store.digests() <= own
        # The same key may not sign two stages; a stage's key does not sign another's manifest.
        with pytest.raises(RequestRejected) as refused:
            app.client().register_trainer_key(TrainerKey(public_key=stage_0.public_key, stage=1))
        assert refused.value.status == 409
        forged = Manifest.model_validate_json(app.client().manifest_bytes(2, "delta", None, 1))
        forged = sign(
            forged.model_copy(update={"version": 3, "parent": 2, "parent_state_sha256": forged.state_sha256}),
            stage_0.key,
        )
        with pytest.raises(RequestRejected) as refused:
            app.client().upload_manifest(3, "delta", forged.model_dump_json().encode(), None, 1)
        assert refused.value.status == 422 and "signed" in refused.value.detail
    finally:
        app.close()


def test_a_stage_manifest_carries_exactly_its_stage(tmp_path: Path) -> None:
    states = stage_states(0)
    stage_map = StageMap.even(2, STAGES, tied_embeddings=True)
    from decentrl.weights.publisher import build_manifest

    def manifest(stage: int, state: dict) -> Manifest:
        built, _ = build_manifest(0, None, state, "bfloat16", 4096, state_hash(state))
        return built.model_copy(update={"stage_map": stage_map, "stage": stage})

    assert check_layout(manifest(0, states[0])) is None and check_layout(manifest(1, states[1])) is None
    stranger = {
        **states[0],
        "model.layers.1.mlp.up_proj.weight": states[1]["model.layers.1.mlp.up_proj.weight"],
    }
    assert "does not hold" in (check_layout(manifest(0, stranger)) or "")
    partial = {k: v for k, v in states[1].items() if not k.startswith("model.layers.1.")}
    assert "every layer" in (check_layout(manifest(1, partial)) or "")
    assert "does not exist" in (check_layout(manifest(2, states[1])) or "")


@pytest.mark.slow  # CI time: `make test-all` runs it
def test_peers_mode_keeps_every_chunk_off_the_coordinators_disk(tmp_path: Path, model_dir: Path) -> None:
    app = App(run_config("peers"), tmp_path / "run", model_dir)
    chunk_dirs = [tmp_path / f"trainer-{stage}" for stage in range(STAGES)]
    servers: list[TrainerChunks] = []
    try:
        stages = publishers(app, tmp_path, chunk_dirs)
        servers = [TrainerChunks(stage.chunks, index, keep_versions=64) for index, stage in enumerate(stages)]  # type: ignore[arg-type]
        for version in range(3):
            states = stage_states(version)
            for index, publisher in enumerate(stages):
                done = publisher.publish_state(states[index], version)
                for item in done:
                    servers[index].record((item.version, item.kind, item.anchor), item.chunks)
                servers[index].announce(app.client(), version)
        client = app.client()
        assert client.latest_weights().version == 2  # type: ignore[union-attr]
        with pytest.raises(RequestRejected) as refused:
            client.upload_chunk(hashlib.sha256(b"x").hexdigest(), b"x")
        assert refused.value.status == 409
        listed = client.peers()
        assert [(peer.worker_id, peer.established) for peer in listed[:2]] == [
            ("stage-trainer-0", True),
            ("stage-trainer-1", True),
        ]
        for stage in range(STAGES):
            sync = holder_sync(app, stage, tmp_path / f"holder-{stage}")
            sync.sync_to(2)
            assert state_hash(sync.state) == state_hash(states[stage])
            assert sync.fetcher.bytes_from["coordinator"] == 0
            assert sync.fetcher.bytes_from[f"stage-trainer-{stage}"] > 0
        # A stage trainer is the only source of its stage: a holder that found it down twice
        # still asks it once it is back (a worker peer would be dropped for good).
        late = holder_sync(app, 1, tmp_path / "late-holder")
        servers[1].close()
        for _ in range(2):
            with pytest.raises((VerificationFailed, NoRoute)):  # no source: every route struck
                late.sync_to(2)
        assert late.fetcher.failed_from["stage-trainer-1"] >= 2
        servers[1] = TrainerChunks(servers[1].store, 1, keep_versions=64)
        servers[1].announce(app.client(), 2)
        # ... even when established peers that hold nothing crowd its list and it failed often
        # (weighted at random it would hardly ever be asked).
        decoys = [PeerServer(ChunkStore(tmp_path / f"decoy-{i}")).start() for i in range(3)]
        late.fetcher.peers = [
            *app.client().peers(),
            *(
                PeerInfo(worker_id=f"decoy-{i}", url=d.url, version=2, established=True)
                for i, d in enumerate(decoys)
            ),
        ]
        late.fetcher.failed_from["stage-trainer-1"] = 50
        late.sync_to(2)
        for decoy in decoys:
            decoy.stop()
        assert state_hash(late.state) == state_hash(states[1])
        # Not a byte of a chunk reached the coordinator's run directory.
        stored = [p for p in (tmp_path / "run").rglob("*") if p.is_file() and "chunks" in p.parts]
        assert stored == []
        payload = sum(path.stat().st_size for d in chunk_dirs for path in d.rglob("*") if path.is_file())
        assert payload > 100_000  # the trainers hold them
    finally:
        for server in servers:
            server.close()
        app.close()


def test_a_pending_stage_manifest_survives_a_coordinator_restart(tmp_path: Path, model_dir: Path) -> None:
    app = App(run_config("coordinator"), tmp_path / "run", model_dir)
    try:
        stage_0, stage_1 = publishers(app, tmp_path)
        states = stage_states(0)
        stage_0.publish_state(states[0], 0)
        stage_1.publish_state(states[1], 0)
        states = stage_states(1)
        stage_0.publish_state(states[0], 1)  # answered 200: durable, though v1 is not complete
        app.restart()
        for publisher in (stage_0, stage_1):
            publisher.client = app.client()
        stage_1.publish_state(states[1], 1)
        assert app.client().latest_weights().version == 1  # type: ignore[union-attr]
        sync = holder_sync(app, 0, tmp_path / "holder")
        sync.sync_to(1)
        assert state_hash(sync.state) == state_hash(states[0])
        with pytest.raises(NoRoute):  # v2 was never published by both
            holder_sync(app, 0, tmp_path / "holder-2").sync_to(2)
    finally:
        app.close()


def test_a_patch_may_name_a_pruned_anchor_of_its_stage(tmp_path: Path, model_dir: Path) -> None:
    """The run's base stays an anchor after its manifests are pruned (a newer snapshot took over):
    the coordinator keeps every stage's hash of every published version to check it against."""
    app = App(run_config("coordinator", snapshot_every=3, keep_versions=2), tmp_path / "run", model_dir)
    try:
        stages = publishers(app, tmp_path)
        for version in range(6):
            states = stage_states(version)
            for index, publisher in enumerate(stages):
                publisher.publish_state(states[index], version)
        index = app.client().weights_index()
        assert min(entry.version for entry in index) == 3  # v0-v2 pruned
        anchored = {(e.stage, e.anchor) for e in index if e.kind == "patch" and e.version == 5}
        assert {(0, 0), (1, 0)} <= anchored, anchored
        sync = holder_sync(app, 1, tmp_path / "holder")
        sync.sync_to(5)
        assert state_hash(sync.state) == state_hash(states[1])
    finally:
        app.close()
