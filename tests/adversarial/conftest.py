"""Fixtures of the adversarial suite: bare coordinator processes on a tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from adversarial.processes import Coordinator
from decentrl.config import ModelConfig


@pytest.fixture
def start_coordinator(tmp_path: Path):
    """Start a coordinator with some config overrides (stopped at the end of the test)."""
    from decentrl.model.tiny import build_tiny, save_model_dir

    model, tokenizer = build_tiny(ModelConfig(hidden_size=64, num_heads=2, intermediate_size=128))
    model_dir = save_model_dir(model, tokenizer, tmp_path / "model")
    started: list[Coordinator] = []

    def start(overrides: list[str]) -> Coordinator:
        started.append(Coordinator(model_dir, tmp_path / "run", overrides))
        return started[-1]

    yield start
    for coordinator in started:
        coordinator.role.stop()
