"""The code task's problems and turn: a small Python function to write, its hidden tests.

Problems are procedural (a family of function specs with seeded constants), so train and held-out
splits are disjoint by the hash of their text and need no data download. The model answers with
the function's source (a ```python fence is allowed). The reward is `code_reward`: the hidden
asserts are executed against the solution inside the sandbox and judged outside it
(`scoring.score_solution`), so `os._exit(0)` or an always-equal object earn nothing. The hidden
tests never enter the prompt.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

from decentrl.config import SandboxConfig
from decentrl.envs.base import Problem, SingleTurnEnv, Split, TeacherHabits, split_of

FENCE = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)
Spec = tuple[str, str, Callable[[Any], object], Callable[[random.Random], object]]


def _specs(a: int, b: int) -> list[Spec]:
    """(description, reference solution, reference function, input sampler) for constants a, b."""
    return [
        (
            f"f(x) returns {a} * x + {b}",
            f"def f(x):\n    return {a} * x + {b}",
            lambda x: a * x + b,
            lambda r: r.randint(-50, 50),
        ),
        (
            f"f(xs) returns the sum of the items of the list xs that are greater than {b}",
            f"def f(xs):\n    return sum(x for x in xs if x > {b})",
            lambda xs: sum(x for x in xs if x > b),
            lambda r: [r.randint(-20, 20) for _ in range(r.randint(0, 6))],
        ),
        (
            f"f(s) returns the string s repeated {a} times",
            f"def f(s):\n    return s * {a}",
            lambda s: s * a,
            lambda r: "".join(r.choice("abc") for _ in range(r.randint(0, 3))),
        ),
        (
            f"f(n) returns the number of integers k with 0 <= k < n that are divisible by {a}",
            f"def f(n):\n    return len([k for k in range(max(n, 0)) if k % {a} == 0])",
            lambda n: len([k for k in range(max(n, 0)) if k % a == 0]),
            lambda r: r.randint(0, 60),
        ),
    ]


def solution_code(text: str) -> str:
    """The code of an answer: the first ```python fence when there is one, else the whole text."""
    match = FENCE.search(text)
    return match[1] if match else text


def code_reward(completion: str, tests: str, sandbox: SandboxConfig) -> float:
    """The code reward: the fraction of the hidden `tests` that the answer's code passes."""
    from decentrl.envs.coding.hidden_tests import score_solution  # the sandbox: imported where it runs

    return score_solution(solution_code(completion), tests, sandbox).reward


class CodeTask(SingleTurnEnv):
    name = "code"

    def __init__(self, num_tests: int = 5, sandbox: dict | None = None) -> None:
        self.num_tests = num_tests
        self.sandbox = SandboxConfig(**(sandbox or {}))

    def problem(self, seed: int, split: Split) -> Problem:
        rng = random.Random(f"{self.name}:{split}:{seed}")
        while True:
            a, b = rng.randint(2, 9), rng.randint(-9, 9)
            description, reference, function, sample = rng.choice(_specs(a, b))
            prompt = f"Write a Python function: {description}."
            if split_of(prompt) == split:
                break
        inputs = [sample(rng) for _ in range(self.num_tests)]
        tests = "\n".join(f"assert f({x!r}) == {function(x)!r}" for x in inputs)
        return Problem(
            seed=seed,
            split=split,
            prompt=({"role": "user", "content": prompt},),
            answer=reference,
            info={"tests": tests},
        )

    def score(self, problem: Problem, completion: str) -> float:
        return code_reward(completion, problem.info["tests"], self.sandbox)

    def demonstration(self, problem: Problem, rng: random.Random, teacher: TeacherHabits) -> list[str]:
        return [problem.answer]
