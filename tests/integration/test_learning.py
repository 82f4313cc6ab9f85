"""End-to-end learning: `decentrl demo` as a user runs it, shortened to fit CI.

The short run warm-starts with fewer SFT steps and trains 100 versions; it must still improve
held-out greedy accuracy clearly, with workers running ahead of the trainer (staleness > 0).
The full default demo (600 versions) is the slow test below.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def run_demo(tmp_path, *overrides: str, timeout: float, config: Path | None = None) -> dict:
    args = [
        sys.executable,
        "-m",
        "decentrl",
        "demo",
        "--run-dir",
        str(tmp_path / "run"),
        "--set",
        f"sft.cache_dir={str(tmp_path / 'cache')!r}",
        *(["--config", str(config)] if config else []),
    ]
    for override in overrides:
        args += ["--set", override]
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "summary:" in done.stdout
    assert (tmp_path / "run" / "learning_curve.png").stat().st_size > 10_000
    return json.loads((tmp_path / "run" / "summary.json").read_text())


def check_summary(summary: dict) -> None:
    for key in (
        "eval_before",
        "eval_after",
        "num_policy_versions",
        "num_rollouts_accepted",
        "num_rollouts_rejected",
        "mean_staleness",
        "wall_seconds",
    ):
        assert key in summary, key
    assert summary["num_rollouts_rejected"] == 0  # honest workers are never rejected
    assert summary["mean_staleness"] > 0  # workers really ran ahead of the trainer


def test_short_demo_improves_held_out_accuracy(tmp_path):
    summary = run_demo(
        tmp_path,
        "sft.steps=1000",
        "trainer.num_steps=100",
        "trainer.eval_every=20",
        "task.eval_size=200",
        timeout=900,
    )
    check_summary(summary)
    assert summary["num_policy_versions"] == 100
    assert summary["eval_after"] >= summary["eval_before"] + 0.10, summary


@pytest.mark.slow
def test_default_demo_meets_the_bar(tmp_path):
    summary = run_demo(tmp_path, timeout=1800)
    check_summary(summary)
    assert summary["eval_after"] >= summary["eval_before"] + 0.15, summary
    assert summary["rl_wall_seconds"] <= 600
