"""pass@k, Wilson and mean intervals against hand-computed values."""

from __future__ import annotations

import math

import pytest

from decentrl.eval.scores import mean_interval, pass_at_k, wilson, z_value


def test_pass_at_k_matches_the_binomial_ratio():
    # n = 5, c = 2, k = 2: 1 - C(3, 2) / C(5, 2) = 1 - 3 / 10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)  # pass@1 is the share correct
    assert pass_at_k(8, 3, 8) == 1.0  # all samples drawn: solved if any is correct
    assert pass_at_k(8, 6, 3) == 1.0  # fewer wrong samples than draws
    assert pass_at_k(4, 0, 2) == 0.0
    # n = 10, c = 1, k = 4: 1 - C(9, 4) / C(10, 4) = 1 - 126 / 210
    assert pass_at_k(10, 1, 4) == pytest.approx(1 - 126 / 210)
    for n, c, k in [(20, 7, 5), (16, 3, 8)]:
        assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


def test_wilson_interval_of_8_in_10():
    assert z_value(0.95) == pytest.approx(1.959964, abs=1e-6)
    score = wilson(8, 10, 0.95)
    assert score.value == 0.8
    assert score.low == pytest.approx(0.4902, abs=1e-4)
    assert score.high == pytest.approx(0.9433, abs=1e-4)
    zero = wilson(0, 20, 0.95)  # not degenerate at 0 %
    assert zero.low == pytest.approx(0.0, abs=1e-12) and zero.high == pytest.approx(0.1611, abs=1e-4)


def test_mean_interval_uses_the_standard_error_over_problems():
    score = mean_interval([0.2, 0.4, 0.6], 0.95)
    # sd 0.2, se 0.2 / sqrt(3) = 0.11547, half 1.96 * se = 0.22632
    assert score.value == pytest.approx(0.4)
    assert score.low == pytest.approx(0.17368, abs=1e-5)
    assert score.high == pytest.approx(0.62632, abs=1e-5)
    assert mean_interval([0.0, 1.0, 1.0, 0.0], 0.95).low == 0.0  # clipped to [0, 1]
    single = mean_interval([0.5], 0.95)
    assert single.low == single.high == 0.5


def test_finished_answers_and_the_accuracy_among_them():
    """Of 5 greedy answers 4 ended on their own and 3 of those are right; the one cut off by the
    budget was right by luck and counts in pass@1 only."""
    from decentrl.eval.evaluate import EvalResult

    stops = ["final_answer", "final_answer", "max_tokens", "final_answer", "final_answer"]
    rewards = [1.0, 1.0, 1.0, 0.0, 1.0]
    answers = [
        {"index": i, "stop": s, "finished": s == "final_answer", "reward": r}
        for i, (s, r) in enumerate(zip(stops, rewards, strict=True))
    ]
    result = EvalResult(accuracy=0.8, num_problems=5, examples=[], greedy=wilson(4, 5, 0.95), answers=answers)
    assert result.finished_share == 0.8
    assert result.accuracy_when_finished == 0.75
    scores = result.format_scores(0.95)
    assert scores["finished"] == wilson(4, 5, 0.95)
    assert scores["pass@1_greedy_finished"] == wilson(3, 4, 0.95)
    assert scores["pass@1_greedy_finished"].value == 0.75


def test_no_finished_answer_has_no_accuracy_among_finished():
    from decentrl.eval.evaluate import EvalResult

    answers = [{"index": 0, "stop": "max_tokens", "finished": False, "reward": 0.0}]
    result = EvalResult(accuracy=0.0, num_problems=1, examples=[], greedy=wilson(0, 1, 0.95), answers=answers)
    assert result.finished_share == 0.0 and result.accuracy_when_finished is None
    assert set(result.format_scores(0.95)) == {"finished"}
