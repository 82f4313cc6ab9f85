"""The math task's problems and turn: generated problems, the gold answer to box.

Two sources, both generated here (no download):
- `algebra` (default): procedural problems of the chosen kinds: `linear` ("Solve 3x+7=22 for x."),
  `fraction` ("Compute 3/4+5/6.", gold `\\frac{19}{12}`, so `19/12`, `1\\frac{7}{12}` and
  `1.583333` are all right) and `power` ("Compute 2^5."); small numbers, short enough for the tiny
  character model.
- `gsm_symbolic`: reasoning-gym's GSM-Symbolic templates (extra `envs`), grade-school word
  problems with integer answers, as chat prompts.

The split of a problem is a hash of its text, so train and held-out problems are disjoint. The
reward is `grading.grade` (exactly one box, one value, symbolically equal to the gold); it runs in
the coordinator's scoring pool, since math-verify needs a main thread for its timeouts.
"""

from __future__ import annotations

import random
from fractions import Fraction
from typing import Literal

from decentrl.envs.base import Problem, SingleTurnEnv, Split, TeacherHabits, split_of
from decentrl.envs.mathematics.grading import grade

KINDS = ("linear", "fraction", "power")
ATTEMPTS = 256  # draws per problem to land in the wanted split


def _latex(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def _algebra(kind: str, rng: random.Random) -> tuple[str, Fraction]:
    if kind == "linear":
        a, x, b = rng.randint(2, 9), rng.randint(-9, 9), rng.randint(-20, 20)
        sign = "+" if b >= 0 else "-"
        return f"Solve {a}x{sign}{abs(b)}={a * x + b} for x.", Fraction(x)
    if kind == "fraction":
        p, q, r, s = rng.randint(1, 9), rng.randint(2, 9), rng.randint(1, 9), rng.randint(2, 9)
        return f"Compute {p}/{q}+{r}/{s}.", Fraction(p, q) + Fraction(r, s)
    base, exponent = rng.randint(2, 5), rng.randint(2, 4)
    return f"Compute {base}^{exponent}.", Fraction(base**exponent)


class MathTask(SingleTurnEnv):
    name = "math"

    def __init__(
        self,
        source: Literal["algebra", "gsm_symbolic"] = "algebra",
        kinds: str | list[str] = "linear",
        prompt_format: Literal["chat", "raw"] = "raw",
    ) -> None:
        self.kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        unknown = sorted(set(self.kinds) - set(KINDS))
        if not self.kinds or unknown:
            raise ValueError(f"math kinds must be among {', '.join(KINDS)}; got {self.kinds}")
        if source not in ("algebra", "gsm_symbolic"):
            raise ValueError(f"math source must be 'algebra' or 'gsm_symbolic', got {source!r}")
        if source == "gsm_symbolic":
            from decentrl.envs.reasoning_gym import ReasoningGym  # raises naming the extra when absent

            self._gym = ReasoningGym("gsm_symbolic", prompt_format="chat")
        try:
            import math_verify  # noqa: F401
        except ImportError:
            raise ValueError(
                "the math environment needs math-verify: pip install 'decentrl[rewards]'"
            ) from None
        self.source = source
        self.prompt_format = prompt_format

    def problem(self, seed: int, split: Split) -> Problem:
        if self.source == "gsm_symbolic":
            item = self._gym.problem(seed, split)
            instruction = "\nPut the final answer in \\boxed{}."
            prompt = ({"role": "user", "content": item.text + instruction},)
            return Problem(seed=seed, split=split, prompt=prompt, answer=item.answer)
        rng = random.Random(f"{self.name}:{split}:{seed}")
        for _ in range(ATTEMPTS):
            text, value = _algebra(rng.choice(self.kinds), rng)
            if split_of(text) == split:
                break
        else:
            raise AssertionError(f"no {split} math problem for seed {seed}")
        prompt = f"{text} " if self.prompt_format == "raw" else ({"role": "user", "content": text},)
        return Problem(
            seed=seed, split=split, prompt=prompt, answer=_latex(value), info={"value": str(value)}
        )

    def score(self, problem: Problem, completion: str) -> float:
        return grade(completion, problem.answer).reward

    def demonstration(self, problem: Problem, rng: random.Random, teacher: TeacherHabits) -> list[str]:
        """The warm-start teacher boxes the gold answer, except that it flips the sign of a
        linear solution with probability `carry_drop` and leaves the box out with probability
        `zero_pad`: two habits the strict reward punishes and RL must unlearn. A flip probability
        of exactly 0.5 erases the sign from the demonstrations (either sign is equally likely
        whatever the problem), leaving RL to learn the rule from scratch; away from 0.5 the warm
        start knows the sign and only its habit has to change."""
        answer = problem.answer
        if problem.text.startswith("Solve") and answer != "0" and rng.random() < teacher.carry_drop:
            answer = answer[1:] if answer.startswith("-") else f"-{answer}"
        if rng.random() < teacher.zero_pad:
            return [answer]
        return [f"\\boxed{{{answer}}}"]
