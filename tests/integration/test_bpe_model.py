"""A model of the shape real checkpoints have (byte-level BPE tokenizer trained here, a
Qwen2.5-style chat template, two EOS ids) runs worker -> coordinator -> trainer end to end:
`configs/real-cpu.toml` shrunk to a few layers and versions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from demo_support import run_demo

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # CI time: `make test-all` runs it

CONFIG = Path(__file__).parents[2] / "configs" / "real-cpu.toml"


def test_bpe_model_with_two_eos_ids_trains_end_to_end(tmp_path) -> None:
    summary = run_demo(
        tmp_path,
        "model.hidden_size=64",
        "model.num_heads=2",
        "model.num_layers=1",
        "model.intermediate_size=128",
        "model.vocab_size=600",
        "sft.steps=20",
        "trainer.num_steps=4",
        "trainer.groups_per_step=4",
        "trainer.eval_every=0",
        "task.eval_size=16",
        "demo.num_workers=1",
        config=CONFIG,
        timeout=600,
    )
    assert summary["num_policy_versions"] == 4
    assert summary["num_rollouts_accepted"] >= 4 * 4 * 8 and summary["num_rollouts_rejected"] == 0
    model_dirs = list((tmp_path / "cache").glob("warmstart-*"))
    assert len(model_dirs) == 1
    config = json.loads((model_dirs[0] / "config.json").read_text())
    assert config["eos_token_id"] == [2, 0] and config["vocab_size"] == 600
