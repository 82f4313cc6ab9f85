"""The staleness study's bookkeeping: cell configs, aggregation over seeds, headline, breakdown."""

from __future__ import annotations

import pytest

from benchmarks.staleness.main import (
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


def test_cell_diagnostics_from_a_history() -> None:
    from benchmarks.staleness.main import cell_diagnostics

    history = [
        {
            "policy_version": 0,
            "metrics": {"mismatch_kl": 0.2, "clip_fraction": 0.01, "m2": 0.3, "is_rejected_fraction": 0.06},
        },
        {
            "policy_version": 25,
            "metrics": {
                "eval_accuracy": 0.7,
                "mismatch_kl": 0.5,
                "clip_fraction": 0.03,
                "m2": 0.1,
                "is_rejected_fraction": 0.02,
            },
        },
        {"policy_version": 150, "metrics": {"eval_accuracy": 0.85, "m2": 0.01, "is_rejected_fraction": 0.0}},
    ]
    plain = cell_diagnostics(history, "decoupled")
    assert plain == {
        "eval_curve": [[25, 0.7], [150, 0.85]],
        "lowest_eval": 0.7,
        "peak_mismatch_kl": 0.5,
        "clip_fraction_mean": 0.02,
    }
    m2po = cell_diagnostics(history, "m2po+with_advantage")
    assert m2po["m2po_versions_0_100"]["m2_mean"] == pytest.approx(0.2)
    assert m2po["m2po_versions_0_100"]["masked_token_fraction_mean"] == pytest.approx(0.04)
    assert m2po["m2po_versions_0_100"]["masked_advantage_share_mean"] is None  # never logged
    assert m2po["m2po_versions_101_150"]["m2_mean"] == pytest.approx(0.01)


def study(cells: list[dict], **protocol) -> dict:
    return {
        "benchmark": "staleness",
        "num_steps": 150,
        "lr": 1.25e-4,
        "minibatches_per_version": 4,
        "lora_rank": 0,
        "target_accuracy": 0.75,
        "cells": cells,
        **protocol,
    }


def test_merge_pools_seeds_and_refuses_another_protocol(tmp_path) -> None:
    import json

    from benchmarks.staleness.merge import merge_studies
    from decentrl.config import ConfigError

    first = tmp_path / "first.json"
    later = tmp_path / "later.json"
    first.write_text(json.dumps(study([cell("a", 0, 0, 0.80), cell("a", 8, 0, 0.70), cell("a", 8, 1, 0.10)])))
    # seed 1's k = 8 cell was re-run: the later file's value replaces the first's
    later_cells = [cell("a", 0, 1, 0.84), cell("a", 8, 1, 0.74)]
    for c in later_cells:
        c["eval_before"] = 0.23
    first_cells = json.loads(first.read_text())
    for c in first_cells["cells"]:
        c["eval_before"] = 0.238
    first.write_text(json.dumps(first_cells))
    later.write_text(json.dumps(study(later_cells)))
    result = merge_studies([first, later], tmp_path / "out")
    assert result["seeds"] == [0, 1] and len(result["cells"]) == 4
    assert result["eval_before"] == [0.23, 0.238]  # two warm starts: compare within each
    assert result["table"]["a"]["8"]["final_accuracy_mean"] == pytest.approx(0.72)
    assert result["headline"] == {"correction": "a", "max_staleness": 8, "drop": pytest.approx(0.10)}
    assert json.loads((tmp_path / "out" / "study.json").read_text())["table"] == result["table"]
    assert (tmp_path / "out" / "seeds.png").stat().st_size > 0

    other = tmp_path / "other.json"
    other.write_text(json.dumps(study([cell("a", 8, 2, 0.8)], lr=5e-4, minibatches_per_version=1)))
    with pytest.raises(ConfigError, match="lr 0.0005 vs 0.000125, minibatches_per_version 1 vs 4"):
        merge_studies([first, other], tmp_path / "no")
    old = tmp_path / "old.json"
    old.write_text(json.dumps({k: v for k, v in study([]).items() if k != "lora_rank"}))
    with pytest.raises(ConfigError, match="does not record lora_rank"):
        merge_studies([first, old], tmp_path / "no")
    assert not (tmp_path / "no").exists()  # nothing written for a refused merge


def test_a_run_config_keeps_its_own_shape_and_correction(tmp_path) -> None:
    """`--config`: the cells change only the bound, the in-flight room and the seed; the config's
    batch shape, lr, LoRA rank and correction stay unless a flag names them."""
    from benchmarks.staleness.main import CONFIG_CORRECTION, base_config_path

    run = tmp_path / "run.toml"
    run.write_text(
        "[trainer]\ngroups_per_step = 4\nlr = 3e-5\nminibatches_per_version = 2\n"
        "[lora]\nrank = 8\n"
        "[algorithm.correction]\nname = 'decoupled'\ncap = 2.5\naction = 'truncate'\n"
    )
    args = parse_args(["--config", str(run), "--num-steps", "30"])
    config = load_config(base_config_path(args), cell_overrides(8, CONFIG_CORRECTION, 1, args))
    assert config.coordinator.max_staleness == 8 and config.coordinator.max_pending_groups == 4 * 9
    assert config.seed == 1 and config.trainer.num_steps == 30
    assert config.trainer.groups_per_step == 4 and config.trainer.lr == pytest.approx(3e-5)
    assert config.trainer.minibatches_per_version == 2 and config.lora.rank == 8
    assert config.algorithm.correction.cap == 2.5  # the config's own correction, untouched
    assert config.worker.delay_seconds == 0.0  # no added delay on a config by default
    assert not config.demo.live and not config.demo.export
    # a flag or --set still wins over the config; a named correction replaces its own
    args = parse_args(["--config", str(run), "--lr", "1e-5", "--set", "trainer.eval_every=5"])
    config = load_config(base_config_path(args), cell_overrides(0, "tis", 0, args))
    assert config.trainer.lr == pytest.approx(1e-5) and config.trainer.eval_every == 5
    assert config.algorithm.correction.name == "tis" and config.coordinator.max_pending_groups == 4


def test_a_missing_config_is_one_line(tmp_path) -> None:
    from decentrl.config_error import ConfigError

    with pytest.raises(ConfigError, match="no such file"):
        parse_args(["--config", str(tmp_path / "nope.toml")])
    with pytest.raises(ConfigError, match="trainer.lr"):  # refused before any cell runs
        parse_args(["--set", "trainer.lr=abc"])
