"""score_solution: hidden tests in the sandbox, verdicts outside it, never from the exit code."""

from __future__ import annotations

import pytest

from decentrl.config import SandboxConfig
from decentrl.envs.coding.hidden_tests import parse_tests, score_solution, strict_equal

FAST = SandboxConfig(wall_seconds=3.0, cpu_seconds=2)
TESTS = """
import math
assert is_even(4)
assert not is_even(7)
assert halve(5) == 2.5
assert pair(1, 2) == (1, 2)
assert 9 == square(3)
assert find([], 1) is None
"""
CORRECT = """
def is_even(n):
    return n % 2 == 0

def halve(x):
    return x / 2

def pair(a, b):
    return (a, b)

def square(x):
    return x * x

def find(items, x):
    return items.index(x) if x in items else None
"""


def test_a_correct_solution_passes() -> None:
    score = score_solution(CORRECT, TESTS, FAST)
    assert score.passed and score.reward == 1.0
    assert [result.detail for result in score.tests] == ["ok"] * 6
    assert score.reason == "6/6 tests passed"


def test_reward_is_the_fraction_passed_and_details_hide_the_expected_value() -> None:
    wrong = CORRECT.replace("return x * x", "return x + x").replace("return (a, b)", "return [a, b]")
    score = score_solution(wrong, TESTS, FAST)
    assert not score.passed and score.reward == pytest.approx(4 / 6)
    failed = {result.statement: result.detail for result in score.tests if not result.passed}
    assert failed == {
        "assert pair(1, 2) == (1, 2)": "wrong value: got [1, 2]",
        "assert 9 == square(3)": "wrong value: got 6",
    }


def test_types_must_match_exactly() -> None:
    sloppy = CORRECT.replace("return n % 2 == 0", "return int(n % 2 == 0)").replace(
        "return x / 2", "return x // 2"
    )
    score = score_solution(sloppy, TESTS, FAST)
    assert [result.passed for result in score.tests] == [False, False, False, True, True, True]


def test_exit_code_zero_without_the_marker_scores_zero() -> None:
    for early_exit in ("import os\nos._exit(0)\n", "import sys\nsys.exit(0)\n"):
        score = score_solution(early_exit + CORRECT, TESTS, FAST)
        assert score.reward == 0.0 and not score.passed


def test_a_solution_that_hangs_scores_zero() -> None:
    score = score_solution(
        CORRECT + "\nwhile True:\n    pass\n", TESTS, FAST.model_copy(update={"cpu_seconds": 1})
    )
    assert score.reward == 0.0
    assert "killed" in score.reason


def test_errors_are_reported_per_test() -> None:
    score = score_solution(CORRECT.replace("return x / 2", "raise RuntimeError('nope')"), TESTS, FAST)
    assert score.reward == pytest.approx(5 / 6)
    assert "RuntimeError: nope" in score.tests[2].detail
    syntax = score_solution("def is_even(n) return 1", TESTS, FAST)
    assert syntax.reward == 0.0 and "SyntaxError" in syntax.tests[0].detail


def test_main_blocks_do_not_run_and_prints_do_not_confuse_the_report() -> None:
    noisy = CORRECT + "\nprint('noise', end='')\nif __name__ == '__main__':\n    input()\n"
    assert score_solution(noisy, TESTS, FAST).passed


def test_the_prelude_can_import_the_solution_module() -> None:
    tests = "from solution import square as sq\nimport solution\nassert sq(4) == 16\nassert solution.halve(3) == 1.5\n"
    assert score_solution(CORRECT, tests, FAST).passed


def test_parse_tests_keeps_expected_values_out_of_the_sandbox() -> None:
    prelude, cases = parse_tests(TESTS)
    assert prelude == "import math"
    assert [case.expression for case in cases] == [
        "is_even(4)",
        "is_even(7)",
        "halve(5)",
        "pair(1, 2)",
        "square(3)",
        "find([], 1)",
    ]
    assert [case.expected for case in cases] == [True, False, 2.5, (1, 2), 9, None]


@pytest.mark.parametrize("bad", ["assert f(1) == g(2)", "assert f(1) < 3", "x = 1", "assert f(x) in [1, 2]"])
def test_malformed_tests_are_a_clear_error(bad: str) -> None:
    with pytest.raises(ValueError, match="assert"):
        parse_tests(bad)


def test_strict_equal() -> None:
    assert strict_equal([1, (2.0, "a")], [1, (2.0, "a")])
    assert strict_equal(0.1 + 0.2, 0.3)
    assert not strict_equal(1, 1.0) and not strict_equal(True, 1) and not strict_equal([1], (1,))
    assert not strict_equal({"a": 1}, {"a": 1.0})
