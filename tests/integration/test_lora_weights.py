"""A small-lr LoRA run through a real coordinator: a bf16 worker and a bf16 verifier compute with
the trainer's update, version after version, not with the base its bf16 rounding would keep."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from weights_support import Coordinator, tiny_model

from benchmarks.lora import trained_versions
from decentrl.client import CoordinatorClient
from decentrl.config import WorkerConfig
from decentrl.engines.hf import HFEngine
from decentrl.model import adapters, lora
from decentrl.model.precision import Precision
from decentrl.verifier.main import Verifier
from decentrl.weights.publisher import Publisher
from decentrl.worker.weights import WorkerWeights

pytestmark = pytest.mark.integration
LR = 1e-5
"""An LLM-scale LoRA rate: on the tiny model most of each version's update is under half a bf16 step."""


def adapted_weights(trainer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainer's effective fp32 weights W0 + B A of its adapted layers."""
    state = lora.publication_state(trainer)
    names = {f"{module}.weight" for module in lora.adapted_modules(state)}
    return {name: tensor for name, tensor in lora.merge(state).items() if name in names}


def test_bf16_worker_and_verifier_compute_with_the_trainers_lora_update(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model = tiny_model(model_dir)
    coordinator = Coordinator(tmp_path, model_dir)
    worker_state = tmp_path / "worker"
    client = coordinator.worker_client(worker_state)
    engine = HFEngine.from_model_dir(model_dir, device="cpu", dtype="bfloat16")
    weights = WorkerWeights(client, engine, WorkerConfig(), worker_state)
    verifier_client = CoordinatorClient(coordinator.url, coordinator.endpoint["trainer_token"], max_wait=30)
    verifier = Verifier(
        verifier_client, model_dir, tmp_path / "verifier", Precision(torch.device("cpu"), torch.bfloat16)
    )
    publisher = Publisher(coordinator.trainer, coordinator.run.weights, tmp_path / "trainer" / "key.pem")
    publisher.register()
    errors = []
    try:
        for version, trainer in enumerate(trained_versions(model, LR, versions=4)):
            publisher.publish_state(lora.publication_state(trainer), version)
            assert weights.follow(threading.Event()) and engine.policy_version == version
            verifier.prepare()
            assert verifier.version == version
            served = [adapters.effective_weights(held) for held in (engine.model, verifier.model)]
            if version == 0:
                trainer_start, served_start = adapted_weights(trainer), served
                continue
            trainer_now = adapted_weights(trainer)
            errors.append(
                [
                    adapters.update_error(trainer_now, trainer_start, now, start)
                    for now, start in zip(served, served_start, strict=True)
                ]
            )
    finally:
        weights.close()
        verifier.close()
        verifier_client.close()
        client.close()
        coordinator.stop()
    # bf16 A and B carry the update to ~0.3 %; merged into bf16 weights, about half of it is lost
    assert all(error < 0.01 for pair in errors for error in pair), errors
