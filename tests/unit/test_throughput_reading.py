"""`decentrl bench throughput`'s reading of a timeline and of a profile, against hand-computed values."""

from __future__ import annotations

import pytest

from benchmarks.throughput.report import accuracy_at, categorise, figures


def timeline() -> list[dict]:
    """Process start at t=100; version 0 published at 110; then a version every 0.5 s."""
    points = [{"version": 0, "time": 110.0, "num_rollouts": 0}]
    for version in range(1, 9):
        point = {"version": version, "time": 110.0 + 0.5 * version, "num_rollouts": 128}
        if version % 2 == 0:
            point["eval_accuracy"] = 0.5 + 0.1 * version / 2  # 0.6, 0.7, 0.8, 0.9
        points.append(point)
    return points


def test_figures_skip_the_warmup_quarter_and_time_from_process_start() -> None:
    result = figures(timeline(), process_start=100.0, threshold=0.75)
    # 8 trained versions: the first 2 are warm-up; versions 3..8 (6 x 128 rollouts) train between
    # version 2 (t=111.0) and version 8 (t=114.0).
    assert result["trained_rollouts_per_second"] == pytest.approx(6 * 128 / 3.0)
    assert result["versions_per_second"] == pytest.approx(2.0)
    assert result["rollouts_trained"] == 8 * 128
    assert result["startup_s"] == 10.0
    assert result["first_version_s"] == 10.5
    assert result["time_to_0.75_s"] == 13.0  # version 6 (accuracy 0.8) at t=113
    assert result["rl_seconds"] == 4.0
    assert result["evals"][0] == [11.0, 1.0, 2, 0.6]


def test_accuracy_after_equal_rl_time_is_the_last_evaluation_within_it() -> None:
    evals = figures(timeline(), process_start=100.0, threshold=0.75)["evals"]
    assert accuracy_at(evals, 0.9) is None
    assert accuracy_at(evals, 2.0) == pytest.approx(0.7)
    assert accuracy_at(evals, 2.9) == pytest.approx(0.7)
    assert accuracy_at(evals, 100.0) == pytest.approx(0.9)


def test_an_arm_that_trained_nothing_reports_no_rate() -> None:
    result = figures([{"version": 0, "time": 5.0, "num_rollouts": 0}], process_start=0.0, threshold=0.75)
    assert result["versions"] == 0 and result["trained_rollouts_per_second"] is None


def test_profile_categories_follow_the_innermost_known_frame() -> None:
    collapsed = "\n".join(
        [
            # generation: torch's Linear under the engine
            "run (decentrl/worker/loop.py:70);_generate (decentrl/engines/hf.py:100);"
            "forward (torch/nn/modules/linear.py:125) 6",
            # SQLite inside an HTTP handler: the store is the innermost known frame
            "handle (uvicorn/protocols/http/h11_impl.py:400);accept (decentrl/coordinator/pipeline/ingest.py:230);"
            "transaction (decentrl/coordinator/db/store.py:70) 2",
            # the trainer waiting on the coordinator's answer
            "run (decentrl/trainer/loop.py:200);_request (decentrl/client.py:150);"
            "read (httpcore/_backends/sync.py:128) 1",
            "mystery (somewhere/else.py:1) 1",
        ]
    )
    assert categorise(collapsed) == {"generation": 0.6, "SQLite": 0.2, "HTTP": 0.1, "other": 0.1}
