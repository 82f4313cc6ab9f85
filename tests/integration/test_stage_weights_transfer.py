"""Staged weights against a real coordinator process: `/v1/info` names the run's stage map, a
manifest split otherwise (or not at all) is refused, and each stage holder's worker fetches exactly
its section's chunks over HTTP and hands its engine only its stage's tensors."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from weights_support import TINY, Coordinator, FaultProxy, publish_versions, tiny_model

from decentrl.client import RequestRejected
from decentrl.config import WorkerConfig
from decentrl.stage_map import StageMap
from decentrl.weights.codec import published_state, state_hash
from decentrl.weights.manifest import Manifest
from decentrl.weights.publisher import Publisher
from decentrl.weights.sections import part
from decentrl.weights.signing import parse_public_key
from decentrl.weights.sync import fetch_state
from decentrl.weights.unique_storage import state_for_publication
from decentrl.worker.weights import WorkerWeights

pytestmark = pytest.mark.integration
STAGED = TINY.model_copy(update={"num_layers": 3, "num_stages": 2})


class StageEngine:
    """What a stage holder's engine sees: whole stages and changed tensors, by version."""

    serves_adapters = True

    def __init__(self) -> None:
        self.policy_version = -1
        self.calls: list[tuple[str, int, set[str]]] = []
        self.tensors: dict[str, torch.Tensor] = {}

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.calls.append(("load", version, set(state_dict)))
        self.tensors = {name: tensor.clone() for name, tensor in state_dict.items()}
        self.policy_version = version

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        self.calls.append(("update", version, set(tensors)))
        self.tensors.update({name: tensor.clone() for name, tensor in tensors.items()})
        self.policy_version = version


@pytest.fixture
def staged(tmp_path: Path):
    model = tiny_model(tmp_path / "model", STAGED)
    coordinator = Coordinator(tmp_path, tmp_path / "model", STAGED, snapshot_every=10, chunk_bytes=8192)
    yield coordinator, model
    coordinator.stop()


@pytest.mark.slow  # about 10 s; in CI the staged run of test_pipeline.py fetches by stage over HTTP
def test_stage_holders_fetch_only_their_sections_and_the_coordinator_keeps_the_map(staged, tmp_path) -> None:
    coordinator, model = staged
    stage_map = coordinator.trainer.info().stage_map
    assert stage_map == StageMap(bounds=(0, 2, 3), tied_embeddings=True)
    key_path = tmp_path / "trainer" / "key.pem"
    publisher = Publisher(coordinator.trainer, coordinator.run.weights, key_path, stage_map)
    publisher.register()
    publish_versions(publisher, model, range(0, 2), fraction=0.05)

    # Same trainer key, but a manifest split another way, or not at all: refused, nothing published.
    for other in (None, StageMap(bounds=(0, 1, 3), tied_embeddings=True)):
        stray = Publisher(coordinator.trainer, coordinator.run.weights, key_path, other)
        with pytest.raises(RequestRejected) as refused:
            stray.publish(model, 2)
        assert refused.value.status == 409 and "stage" in refused.value.detail
    assert coordinator.trainer.latest_weights().version == 1

    proxy = FaultProxy(coordinator.url)
    stop = threading.Event()
    holders = []
    try:
        for stage in range(stage_map.num_stages):
            root = tmp_path / f"holder-{stage}"
            client = coordinator.worker_client(root, proxy.url)
            config = WorkerConfig(coordinator_url=proxy.url, serve_peers=False)
            engine = StageEngine()
            weights = WorkerWeights(client, engine, config, root, stage=stage)  # type: ignore[arg-type]
            holders.append((stage, engine, weights))
            proxy.requests.clear()
            assert weights.follow(stop)
            route = [(0, "snapshot", None), (1, "delta", None)]
            manifests = [Manifest.model_validate_json(client.manifest_bytes(*step)) for step in route]
            expected = {chunk.sha256 for m in manifests for chunk in part(m, stage).chunks}
            requested = {path.rsplit("/", 1)[-1] for path in proxy.chunk_requests()}
            assert requested == expected and weights.fetcher.store.digests() == expected
            names = set(manifests[-1].stages[stage].tensors)  # type: ignore[index]
            assert names == set(stage_map.names(stage, [t.name for t in manifests[-1].tensors]))
            assert engine.calls == [("load", 1, names)]
        publish_versions(publisher, model, range(2, 3), fraction=0.05)
        published = published_state(state_for_publication(model), "bfloat16")
        for _, engine, weights in holders:
            assert weights.follow(stop)
            kind, version, changed = engine.calls[-1]
            assert (kind, version) == ("update", 2) and changed <= set(engine.tensors)
            assert state_hash(engine.tensors) == state_hash(
                {name: published[name] for name in engine.tensors}
            )
    finally:
        for _, _, weights in holders:
            weights.close()
        proxy.stop()

    # A full-model consumer (verifier, evaluation) reads the same staged manifests whole.
    state = fetch_state(coordinator.trainer, 2, parse_public_key(publisher.public_key), tmp_path / "full")
    assert state_hash(state) == state_hash(published)
