"""The packaged benchmarks: HumanEval problems pass on their canonical solution in the sandbox and
fail on wrong ones; MATH500 grades the gold answer right and others wrong; neither trains."""

from __future__ import annotations

import pytest

from decentrl.envs import load_environment
from decentrl.envs.benchmarks import HumanEval, Math500


def fenced(code: str) -> str:
    return f"Here it is:\n```python\n{code}```\n"


def test_humaneval_holds_its_164_problems_as_chat_prompts() -> None:
    env = load_environment("humaneval")
    assert isinstance(env, HumanEval) and len(env) == 164
    problem = env.problem(0, "eval")
    assert problem.prompt[0]["role"] == "user"
    assert "def has_close_elements(" in problem.text and problem.info["task_id"] == "HumanEval/0"
    with pytest.raises(ValueError, match="no train split"):
        env.problem(0, "train")


@pytest.mark.parametrize("seed", [0, 2, 32, 163])
def test_a_canonical_humaneval_solution_passes_and_a_stub_fails(seed: int) -> None:
    env = HumanEval()
    problem = env.problem(seed, "eval")
    item = env.problems[seed]
    # The whole function restated, as an instruct model answers, and the body alone.
    assert env.score(problem, fenced(item["prompt"] + item["canonical_solution"])) == 1.0
    assert env.score(problem, item["canonical_solution"]) == 1.0
    assert env.score(problem, fenced(item["prompt"] + "    return None\n")) == 0.0


def test_a_humaneval_answer_that_exits_early_or_prints_the_marker_does_not_pass() -> None:
    env = HumanEval()
    problem = env.problem(0, "eval")
    header = env.problems[0]["prompt"]
    assert env.score(problem, fenced("import os\nos._exit(0)\n")) == 0.0
    # A guessed marker cannot help: the nonce is fresh per run and must appear exactly once.
    assert env.score(problem, fenced(header + "    print('0' * 32)\n    return True\n")) == 0.0


def test_math500_grades_the_gold_answer_and_refuses_others() -> None:
    env = load_environment("math500")
    assert isinstance(env, Math500) and len(env) == 311
    problem = env.problem(5, "eval")
    assert problem.text.endswith("Put the final answer in \\boxed{}.")
    assert env.score(problem, f"So the answer is \\boxed{{{problem.answer}}}.") == 1.0
    assert env.score(problem, "So the answer is \\boxed{123456789}.") == 0.0
    assert env.score(problem, problem.answer) == 0.0  # no box: no credit
