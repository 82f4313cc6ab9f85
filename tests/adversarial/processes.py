"""A bare coordinator process on loopback, stopped and started again on one run directory; a signed
client registered with it; an arena on a confident tiny model."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from benchmarks.adversarial.arena import Arena
from decentrl.client import CoordinatorClient
from decentrl.config import ModelConfig, load_config
from decentrl.launch.local import Role, wait_for_coordinator
from decentrl.protocol import RegisterRequest
from decentrl.trust.identity import Signer


class Coordinator:
    def __init__(self, model_dir: Path, run_dir: Path, overrides: list[str]) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        config = load_config(None, overrides)
        (run_dir / "config.json").write_text(config.model_dump_json())
        self.args = ["coordinator", "--config", str(run_dir / "config.json"), "--run-dir", str(run_dir)]
        self.args += ["--model-dir", str(model_dir), "--port", "0"]
        self.run_dir = run_dir
        self.start()

    def start(self) -> None:
        self.role = Role("coordinator", self.args, self.run_dir)
        endpoint = wait_for_coordinator(self.run_dir, self.role)
        self.url, self.enroll_token = endpoint["url"], endpoint["enroll_token"]

    def restart(self) -> None:
        self.role.stop()
        self.start()

    def violations(self, worker_id: str) -> int:
        with sqlite3.connect(self.run_dir / "coordinator.db") as db:
            query = "SELECT COUNT(*) FROM events WHERE kind = 'violation' AND worker_id = ?"
            return db.execute(query, (worker_id,)).fetchone()[0]


def register(coordinator: Coordinator) -> tuple[CoordinatorClient, str]:
    client = CoordinatorClient(coordinator.url, max_wait=10)
    client.signer = Signer(Ed25519PrivateKey.generate())
    request = RegisterRequest(name="w", public_key=client.signer.public_key)
    answer = client.register(request, coordinator.enroll_token)
    client.token = answer.token
    return client, answer.worker_id


@contextmanager
def confident_arena(root: pytest.TempPathFactory, overrides: list[str], **options: int) -> Iterator[Arena]:
    """An `Arena` (coordinator, trainer, verifier on loopback) on a tiny model whose final norm is
    scaled up, so that it samples confidently like a trained model rather than uniformly."""
    from decentrl.model.tiny import build_tiny, save_model_dir

    model, tokenizer = build_tiny(ModelConfig(hidden_size=64, num_heads=2, intermediate_size=128))
    with torch.no_grad():
        model.model.norm.weight.mul_(30.0)
    model_dir = save_model_dir(model, tokenizer, root.mktemp("model"))
    arena = Arena(model_dir, root.mktemp("run"), overrides, **options)
    try:
        yield arena
    finally:
        arena.close()


@contextmanager
def vision_arena(root: pytest.TempPathFactory, overrides: list[str]) -> Iterator[Arena]:
    """An `Arena` on a tiny vision-language model (LLaVA, `model/tiny_vlm.py`), one version."""
    from decentrl.config.run import VisionTowerConfig
    from decentrl.model.tiny import save_model_dir
    from decentrl.model.tiny_vlm import build_tiny_vlm

    config = ModelConfig(hidden_size=64, num_heads=2, intermediate_size=128, vision=VisionTowerConfig())
    model, processor = build_tiny_vlm(config)
    model_dir = save_model_dir(model, processor, root.mktemp("vlm"))
    arena = Arena(model_dir, root.mktemp("run"), overrides, num_versions=1)
    try:
        yield arena
    finally:
        arena.close()
