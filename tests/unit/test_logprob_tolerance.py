"""The log-prob tolerance per engine class (trust/logprob_tolerance.py), against hand-computed values."""

from __future__ import annotations

import math

import pytest

from decentrl.config import DEMO_CONFIG, ConfigError, load_config
from decentrl.trust.logprob_tolerance import CALIBRATED, LOOSEST, LogprobTolerance, ToleranceTable, calibrate
from decentrl.trust.repeats import detector_step


def test_mean_test_factors_by_hand() -> None:
    tolerance = LogprobTolerance(mean=0.01, max=0.5)
    assert tolerance.bet == pytest.approx(50.0)  # BET 0.5 / mean 0.01
    assert tolerance.token_log_evidence(0.0) == pytest.approx(math.log(0.5))  # 1 + 50 (0 - 0.01)
    assert tolerance.token_log_evidence(0.01) == pytest.approx(0.0)
    assert tolerance.token_log_evidence(0.03) == pytest.approx(math.log(2.0))  # 1 + 50 (0.03 - 0.01)
    # errors count at most CLIP = 1 nat: 1 + 50 (1 - 0.01) = 50.5
    assert tolerance.token_log_evidence(7.0) == pytest.approx(math.log(50.5))
    assert tolerance.failure(0.5) is None
    assert "0.6 > 0.5" in (tolerance.failure(0.6) or "")


def test_an_honest_error_distribution_at_the_mean_is_a_fair_bet() -> None:
    """Errors 0 (p = 0.75) and 0.04 (p = 0.25): mean 0.01 = the tolerance's; each token's factor
    has expectation exactly 1, so the evidence is a martingale (no drift upward)."""
    tolerance = LogprobTolerance(mean=0.01, max=1.0)
    expectation = 0.75 * math.exp(tolerance.token_log_evidence(0.0)) + 0.25 * math.exp(
        tolerance.token_log_evidence(0.04)
    )
    assert expectation == pytest.approx(1.0)  # 0.75 * 0.5 + 0.25 * (1 + 50 * 0.03) = 0.375 + 0.625


def test_forged_logprobs_cross_the_threshold_in_one_batch_where_honest_ones_sink() -> None:
    """bf16-like honest errors (mean 0.011) against halved claims of tokens with |log p| = 0.3
    (error 0.15), 40 tokens in one verdict batch, under the bfloat16 entry."""
    tolerance = CALIBRATED["*/bfloat16"]
    honest = 40 * tolerance.token_log_evidence(0.011)
    forged = 40 * tolerance.token_log_evidence(0.15)
    threshold = -math.log(0.001 / 2)  # first batch: a_1 = alpha / 2
    assert honest < 0 < threshold < forged
    assert detector_step(None, 0.001, 1, forged) >= 0  # quarantined at the first batch
    assert detector_step(None, 0.001, 1, honest) < 0


def test_lookup_goes_from_specific_to_general_and_unknown_classes_get_the_loosest() -> None:
    table = ToleranceTable(
        {
            "*/float32": LogprobTolerance(mean=0.002, max=0.01),
            "*/bfloat16": LogprobTolerance(mean=0.03, max=10.0),
            "vllm/bfloat16/cuda": LogprobTolerance(mean=0.02, max=5.0),
        }
    )
    assert table.lookup("vllm", "bfloat16", "cuda")[0] == "vllm/bfloat16/cuda"
    assert table.lookup("vllm", "bfloat16", "cpu")[0] == "*/bfloat16"
    assert table.lookup("hf", "float32", "mps")[0] == "*/float32"
    assert table.lookup("openai", "unknown", "unknown") == (
        "*/bfloat16",
        LogprobTolerance(mean=0.03, max=10.0),
    )


def test_no_class_is_looser_than_the_bound() -> None:
    for entry in CALIBRATED.values():
        assert entry.mean <= LOOSEST.mean and entry.max <= LOOSEST.max
    with pytest.raises(ValueError, match="looser than the bound"):
        ToleranceTable({"*/bfloat16": LogprobTolerance(mean=0.5, max=10.0)})
    with pytest.raises(ConfigError, match="looser than the bound"):
        load_config(DEMO_CONFIG, ['trust.logprob_tolerances={"vllm/bfloat16"={mean=0.1,max=1.0}}'])
    with pytest.raises(ConfigError, match="engine/dtype"):
        load_config(DEMO_CONFIG, ['trust.logprob_tolerances={"bfloat16"={mean=0.01,max=1.0}}'])
    with pytest.raises(ValueError, match="cannot exceed"):
        LogprobTolerance(mean=0.2, max=0.1)


def test_a_run_keeps_its_stored_table_and_applies_its_own_entries_over_it() -> None:
    stored = {"*/float32": {"mean": 0.001, "max": 0.005}}
    override = {"vllm/bfloat16": LogprobTolerance(mean=0.02, max=4.0)}
    table = ToleranceTable.for_run(override, stored)
    assert table.as_dict() == {
        "*/float32": {"mean": 0.001, "max": 0.005},
        "vllm/bfloat16": {"mean": 0.02, "max": 4.0},
    }
    assert ToleranceTable.for_run({}, None).entries == dict(sorted(CALIBRATED.items()))


def test_calibrate_by_hand() -> None:
    """Token errors 0.001, 0.003, 0.002: mean 0.002, max 0.003; x3 margin: 0.006 and 0.009."""
    result = calibrate([[0.001, 0.003], [0.002]], margin=3.0)
    assert result["tokens"] == 3 and result["rollouts"] == 2
    assert result["token_error_mean"] == pytest.approx(0.002)
    assert result["tolerance"] == {"mean": pytest.approx(0.006), "max": pytest.approx(0.009)}
    entry = LogprobTolerance(mean=0.006, max=0.009)
    expected = sum(entry.token_log_evidence(e) for e in (0.001, 0.003, 0.002)) / 3
    assert result["mean_test_nats_per_token"] == pytest.approx(expected) and expected < 0
    assert result["within_bound"]
    assert calibrate([[0.0123]], margin=1.0)["tolerance"]["max"] == pytest.approx(
        0.013
    )  # rounded up, 2 digits


def test_a_bf16_verifier_judges_with_the_looser_of_its_own_and_the_workers_entry() -> None:
    import sqlite3

    from decentrl.coordinator.trust.tolerances import worker_tolerance

    db = sqlite3.connect(":memory:")
    db.row_factory = sqlite3.Row
    db.execute("CREATE TABLE workers (worker_id TEXT, engine TEXT, dtype TEXT, device TEXT)")
    db.execute("INSERT INTO workers VALUES ('w', 'hf', 'float32', 'cpu')")
    table = ToleranceTable(CALIBRATED)
    assert worker_tolerance(db, table, "w", "float32") == ("*/float32", CALIBRATED["*/float32"])
    key, entry = worker_tolerance(db, table, "w", "bfloat16")
    assert key == "*/float32 + verifier */bfloat16" and entry == LogprobTolerance(mean=0.03, max=10.0)
    tight = LogprobTolerance(mean=0.002, max=0.01)
    assert tight.looser(LogprobTolerance(mean=0.001, max=0.5)) == LogprobTolerance(mean=0.002, max=0.5)


def test_a_run_may_raise_the_cap_for_a_model_whose_honest_engines_need_it():
    """vLLM bf16 on SmolLM2 errs by 0.040 per token, above the shipped cap's mean (0.03): its run
    raises the cap explicitly, and only then may an entry exceed the shipped one."""
    from decentrl.config.trust import TrustConfig

    wide = LogprobTolerance(mean=0.06, max=10.0)
    with pytest.raises(ValueError, match="loosest_tolerance"):
        TrustConfig(logprob_tolerances={"*/bfloat16": wide})
    config = TrustConfig(logprob_tolerances={"*/bfloat16": wide}, loosest_tolerance=wide)
    table = ToleranceTable.for_run(config.logprob_tolerances, None, config.loosest_tolerance)
    assert table.lookup("vllm", "bfloat16", "cpu") == ("*/bfloat16", wide)
    assert table.lookup("mystery", "fp8", "cpu")[1] == wide  # an unknown class gets the loosest entry
    with pytest.raises(ValueError, match="looser than the bound"):
        ToleranceTable.for_run(config.logprob_tolerances, None)  # the shipped cap refuses it
    with pytest.raises(ValueError, match="below the shipped cap"):
        TrustConfig(loosest_tolerance=LogprobTolerance(mean=0.01, max=10.0))
