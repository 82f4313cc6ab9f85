"""The staleness study's bookkeeping: cell configs, aggregation over seeds, headline, breakdown."""

from __future__ import annotations

import pytest

from decentrl.bench.staleness import (
    aggregate,
    breakdowns,
    cell_overrides,
    first_crossing,
    headline,
    parse_args,
)
from decentrl.config import DEMO_CONFIG, load_config


def cell(correction: str, k: int, seed: int, final: float, seconds: float | None = 10.0) -> dict:
    return {
        "correction": correction,
        "max_staleness": k,
        "seed": seed,
        "final_accuracy": final,
        "seconds_to_target": seconds,
        "mean_staleness": float(k),
    }


def test_cell_config_makes_staleness_happen_within_the_bound() -> None:
    args = parse_args(["--num-steps", "50"])
    config = load_config(DEMO_CONFIG, cell_overrides(8, "none+dual_clip", 2, args))
    assert config.coordinator.max_staleness == 8
    assert config.coordinator.max_pending_groups == 16 * 9  # k + 1 batches in flight
    assert config.worker.groups_per_lease == 64 and config.worker.delay_seconds == pytest.approx(0.8)
    assert config.algorithm.correction.name == "none" and config.algorithm.loss.dual_clip == 3.0
    assert config.seed == 2 and config.model.seed == 0  # same warm start, different RL seed
    assert config.trainer.minibatches_per_version == 4  # the trainer's default
    # four steps per version at a quarter of the one-step study's 5e-4
    assert config.trainer.lr == pytest.approx(1.25e-4)
    assert parse_args(["--minibatches", "1"]).lr == pytest.approx(5e-4)
    tis = load_config(DEMO_CONFIG, cell_overrides(4, "tis", 0, args))
    assert tis.algorithm.correction.name == "tis" and tis.algorithm.correction.cap == 2.0  # its own defaults


def test_aggregate_headline_and_breakdown() -> None:
    cells = [
        cell("a", 0, 0, 0.80),
        cell("a", 0, 1, 0.84),
        cell("a", 8, 0, 0.79),
        cell("a", 8, 1, 0.81, None),
        cell("b", 0, 0, 0.80),
        cell("b", 0, 1, 0.84),
        cell("b", 8, 0, 0.70),
        cell("b", 8, 1, 0.74),
        cell("b", 16, 0, 0.50),
    ]
    table = aggregate(cells)
    assert table["a"]["8"]["final_accuracy_mean"] == pytest.approx(0.80)
    assert table["a"]["8"]["final_accuracy_std"] == pytest.approx(0.0141, abs=1e-4)
    assert table["a"]["8"]["seconds_to_target_mean"] is None  # one seed never reached the target
    assert table["a"]["0"]["seconds_to_target_mean"] == 10.0
    # a drops 2 points at k = 8, b drops 10: a is the best, b breaks down at 8 (not first at 16)
    assert headline(table) == {"correction": "a", "max_staleness": 8, "drop": pytest.approx(0.02)}
    assert breakdowns(table) == {"a": None, "b": 8}


def test_first_crossing_reads_the_in_run_evaluations() -> None:
    history = [
        {"policy_version": 25, "metrics": {"eval_accuracy": 0.5, "elapsed_seconds": 30.0}},
        {"policy_version": 40, "metrics": {"loss": 0.1}},
        {"policy_version": 50, "metrics": {"eval_accuracy": 0.76, "elapsed_seconds": 61.5}},
    ]
    assert first_crossing(history, 0.75) == (50, 61.5)
    assert first_crossing(history, 0.9) == (None, None)
