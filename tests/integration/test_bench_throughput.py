"""`decentrl bench throughput` for real: its JSON holds measurements of the runs it made.

The short run takes the synchronous arm only, on the short demo's cached warm start (the
`short_demo` fixture made it); the slow one runs all three arms briefly.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def bench(tmp_path: Path, cache: Path, *args: str, timeout: float) -> dict:
    command = [
        sys.executable, "-m", "decentrl", "bench", "throughput", "--out", str(tmp_path / "bench"),
        "--set", "sft.steps=600", "--set", f"sft.cache_dir={str(cache)!r}", "--set", "trainer.eval_size=64",
        *args,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.integration
@pytest.mark.slow  # a minute after the short demo; the bench's arithmetic has unit tests
def test_the_synchronous_arm_reports_its_measured_rate_and_profile(short_demo, tmp_path: Path) -> None:
    run_dir, _ = short_demo
    budget = 25  # version 1 came 11 s after the process started at load 14 (4-5 s on a quiet machine)
    summary = bench(
        tmp_path, run_dir.parent / "cache", "--arms", "sync", "--budget-s", str(budget), "--eval-every", "1",
        "--profile-fraction", "0.4", timeout=120 + budget,
    )  # fmt: skip
    sync = summary["arms"]["sync"]
    written = json.loads((tmp_path / "bench" / "sync" / "sync.json").read_text())
    end = written["process_start"] + budget  # a version finished past the budget is not counted
    trained = [p for p in written["timeline"] if p["version"] > 0 and p["time"] <= end]
    assert sync["versions"] == len(trained) >= 1
    assert sync["rollouts_trained"] == sum(p["num_rollouts"] for p in trained) == 128 * len(trained)
    assert 0 < sync["first_version_s"] < budget and sync["startup_s"] < sync["first_version_s"]
    assert sync["trained_rollouts_per_second"] > 0
    assert [e[2] for e in sync["evals"]] == [p["version"] for p in trained]
    assert all(0.0 <= e[3] <= 1.0 for e in sync["evals"])
    role = sync["profile"]["roles"]["sync"]
    assert role["cpu_seconds"] > 0.3  # the loop computes through its window
    assert {"training", "generation"} & set(role["categories"])
    assert sum(role["categories"].values()) == pytest.approx(1.0, abs=0.01)
    assert Path(summary["plot"]).stat().st_size > 5_000


@pytest.mark.integration
@pytest.mark.slow  # three arms of 50 s each, plus start and stop
def test_three_arms_compare_the_demo_with_the_synchronous_loop(short_demo, tmp_path: Path) -> None:
    run_dir, _ = short_demo
    summary = bench(tmp_path, run_dir.parent / "cache", "--budget-s", "50", timeout=600)
    assert set(summary["arms"]) == {"sync", "demo", "demo-noverify"}
    for name, arm in summary["arms"].items():
        assert arm["versions"] > 0 and arm["trained_rollouts_per_second"] > 0, name
    demo = summary["arms"]["demo"]["profile"]["roles"]
    assert {"coordinator", "trainer", "verifier", "worker-0", "worker-1"} <= set(demo)
    assert "verifier" not in summary["arms"]["demo-noverify"]["profile"]["roles"]
    assert summary["arms"]["demo"]["coordinator_cpu_seconds_per_accepted_rollout"] > 0


@pytest.mark.integration
@pytest.mark.slow  # one colocated arm of 40 s
def test_the_colocated_arm_trains_the_trainers_own_rollouts(short_demo, tmp_path: Path) -> None:
    run_dir, _ = short_demo
    summary = bench(
        tmp_path, run_dir.parent / "cache", "--arms", "colocated", "--budget-s", "40", "--eval-every", "5",
        "--profile-fraction", "0.4", timeout=300,
    )  # fmt: skip
    colocated = summary["arms"]["colocated"]
    assert colocated["versions"] > 0 and colocated["trained_rollouts_per_second"] > 0
    assert set(colocated["trained_by"]) == {"trainer"}  # no worker: every trained rollout is its own
    assert 0 < colocated["mean_staleness"] <= 1.0  # one round ahead: trained one version after sampling
    profile = colocated["profile"]
    assert set(profile["roles"]) == {"coordinator", "trainer"}  # no worker, no verifier
    assert profile["cpu_seconds_per_version"] == pytest.approx(
        sum(role["cpu_seconds"] for role in profile["roles"].values()) / profile["versions_in_window"],
        rel=0.02,
    )
