"""The verifier takes the latest published version while idle before its first job: the first
verdicts (which hold their groups back from the trainer) then wait for no download."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from weights_support import Coordinator, publish_versions, tiny_model

from decentrl.client import CoordinatorClient
from decentrl.model.precision import Precision
from decentrl.verifier.main import Verifier
from decentrl.weights.codec import published_state
from decentrl.weights.publisher import Publisher

pytestmark = pytest.mark.integration


def test_an_idle_verifier_holds_the_latest_version_before_any_job(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model = tiny_model(model_dir)
    coordinator = Coordinator(tmp_path, model_dir)
    try:
        token = coordinator.endpoint["trainer_token"]
        with CoordinatorClient(coordinator.url, token, max_wait=30) as client:
            verifier = Verifier(
                client, model_dir, tmp_path / "cache", Precision(torch.device("cpu"), torch.float32)
            )
            verifier.prepare()  # nothing published yet: nothing to take, try again when idle
            assert verifier.version is None and not verifier.prepared
            publisher = Publisher(coordinator.trainer, coordinator.run.weights, tmp_path / "key.pem")
            publisher.register()
            publish_versions(publisher, model, range(0, 3), fraction=0.01)
            verifier.prepare()
            assert verifier.prepared and verifier.version == 2
            published = published_state(model.state_dict(), coordinator.run.weights.dtype)
            held = verifier.model.state_dict()
            assert all(torch.equal(held[name], tensor.float()) for name, tensor in published.items())
            verifier.close()
    finally:
        coordinator.stop()
