"""`decentrl bench rewards`: a math run, a reward-model run and a judge run, each end to end through
worker -> coordinator -> trainer with held-out accuracy measured by the task's own checker (not by
the reward that trained it); each run improves it. Several minutes each on
2 CPU cores."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pytest

# Each run has BENCH_TIMEOUT_S as a subprocess; the test's own limit (pytest-timeout, 1200 s by
# default) must be longer, or a run that is merely slow on a loaded machine is cut at 20 minutes.
BENCH_TIMEOUT_S = 1800
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(BENCH_TIMEOUT_S + 60)]


def bench(tmp_path, kind: str, *args: str) -> dict:
    run_dir = tmp_path / kind
    command = [
        sys.executable,
        "-m",
        "decentrl",
        "bench",
        "rewards",
        "--kind",
        kind,
        "--run-dir",
        str(run_dir),
    ]
    done = subprocess.run([*command, *args], capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == json.loads((run_dir / "bench.json").read_text())
    return result


def test_math_run_scored_by_math_verify_improves_held_out(tmp_path):
    result = bench(tmp_path, "math", "--num-steps", "40")
    assert result["task"] == "math" and result["terms"][0]["function"] == "math_verify"
    assert result["num_rollouts_accepted"] >= 40 * 16 * 8
    # Every rollout was scored by math-verify in the pool, none failed.
    db = sqlite3.connect(tmp_path / "math" / "coordinator.db")
    assert db.execute("SELECT COUNT(*) FROM reward_scores WHERE failure IS NOT NULL").fetchone() == (0,)
    # The warm start mostly answers with the sign its teacher flipped (configs/math.toml); RL on
    # math-verify's reward unlearns it (0.040 -> 0.410 measured, docs/rewards.md).
    assert result["eval_after"] >= result["eval_before"] + 0.15, result


def test_reward_model_run_improves_the_checked_held_out_score(tmp_path):
    # 25 versions: by 50 the policy has found answers the reward model overrates (docs/rewards.md).
    result = bench(tmp_path, "rm", "--num-steps", "25")
    assert [t["function"] for t in result["terms"]] == ["reward_model"]  # the RM alone rewards
    assert result["reward_model"]["heldout_accuracy"] > 0.7  # pairwise, on held-out problems
    assert result["eval_after"] >= result["eval_before"] + 0.1, result
    log = (tmp_path / "rm" / "logs" / "scorer-reward_model.log").read_text()
    assert "stopped:" in log and " 0 scores" not in log


def test_judge_run_over_a_served_judge_improves_the_checked_held_out_score(tmp_path):
    result = bench(tmp_path, "judge", "--num-steps", "25")
    assert [t["function"] for t in result["terms"]] == ["judge"]
    assert result["terms"][0]["args"]["base_url"].startswith("http://127.0.0.1:")
    assert result["judge"]["heldout_accuracy"] > 0.75
    assert result["eval_after"] >= result["eval_before"] + 0.1, result
