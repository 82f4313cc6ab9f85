"""End-to-end learning: `decentrl demo` as a user runs it, shortened to fit CI.

The short run warm-starts with fewer SFT steps and trains 60 versions; it must still improve
held-out greedy accuracy clearly, with workers running ahead of the trainer (staleness > 0).
The full default demo (600 versions) is the slow test below. The short run is the `short_demo`
fixture (conftest.py), which tests/integration/test_release.py shares.
"""

from __future__ import annotations

import json

import pytest
from demo_support import run_demo

pytestmark = pytest.mark.integration


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
    # Honest workers are never rejected for what they sent, only for arriving late: a worker that
    # sampled just before the trainer ran max_staleness versions ahead (its weights were still
    # loading) has those rollouts refused as stale, with no strike, and resyncs. The full demo saw
    # 2 of 92,354 at load 4.
    rejected = summary["rejected_by_reason"]
    assert set(rejected) <= {"stale"}, rejected
    assert summary["num_rollouts_rejected"] == sum(rejected.values())
    assert summary["num_rollouts_rejected"] <= 0.001 * summary["num_rollouts_accepted"], rejected
    assert summary["mean_staleness"] > 0  # workers really ran ahead of the trainer


def test_short_demo_improves_held_out_accuracy(short_demo):
    _, summary = short_demo
    check_summary(summary)
    assert summary["num_policy_versions"] == 60
    assert summary["eval_after"] >= summary["eval_before"] + 0.10, summary


@pytest.mark.slow
@pytest.mark.timeout(1860)  # the demo subprocess has 1800 s
def test_default_demo_meets_the_bar(tmp_path):
    summary = run_demo(tmp_path, timeout=1800)
    check_summary(summary)
    assert summary["eval_after"] >= summary["eval_before"] + 0.15, summary
    assert summary["rl_wall_seconds"] <= 600


def test_the_demo_forks_its_roles_from_one_import(short_demo):
    """Every role of the demo was forked from the launcher (no role imported torch again), and
    the warm start's evaluation ran beside them."""
    run_dir, summary = short_demo
    for role in ("coordinator", "trainer", "verifier", "worker-0", "worker-1"):
        log = (run_dir / "logs" / f"{role}.log").read_text()
        assert f"{role}: forked from the launcher" in log, role
    assert (run_dir / "logs" / "eval-before.json").is_file()
    assert (
        summary["eval_before"] == json.loads((run_dir / "logs" / "eval-before.json").read_text())["accuracy"]
    )


def test_the_demo_keeps_every_held_out_answer_before_and_after(short_demo):
    """answers-before/after.jsonl hold each greedy answer; the summary's accuracy, finished share
    and accuracy among finished answers are what they say."""
    run_dir, summary = short_demo
    for moment in ("before", "after"):
        lines = (run_dir / f"answers-{moment}.jsonl").read_text().splitlines()
        answers = [json.loads(line) for line in lines]
        assert len(answers) == summary["eval_num_problems"] == 200
        assert [a["index"] for a in answers] == list(range(200))
        assert summary[f"eval_{moment}"] == sum(a["reward"] for a in answers) / 200
        finished = [a for a in answers if a["finished"]]
        assert summary[f"eval_finished_{moment}"] == len(finished) / 200
        assert all(a["finished"] == (a["stop"] == "max_turns") for a in answers)  # one turn each
        if finished:
            among = sum(a["reward"] for a in finished) / len(finished)
            assert summary[f"eval_when_finished_{moment}"] == among
        assert all(set(a) >= {"prompt", "expected", "reply", "stop", "model_tokens"} for a in answers)
    assert summary["eval_finished_after"] > 0.5  # the demo's model ends its answers ("65<eos>")
