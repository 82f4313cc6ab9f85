"""Procedural integer arithmetic: `"317+48="` -> `"365"`, exact-match reward.

Operand sizes are drawn uniformly in 1..num_digits digits, so the task mixes easy (no carry)
and hard (multi-carry, borrow, negative results) problems: a warm-started tiny model gets some
right and many wrong, which is what RL needs. The split of a problem is a hash of its text, so
train and held-out problems are disjoint whatever seeds are used. Prompts are raw text (no chat
template) by default: the embedded demo is a completion task. With `prompt_format = "chat"` the
problem is a chat question ("What is 17 + 48?") for an instruct model, which answers in its own
words ("17 + 48 = 65."): the reward then reads the reply's last integer, and an answer cut off
before its number earns nothing.
"""

from __future__ import annotations

import random
import re
from typing import Literal

from decentrl.envs.base import Problem, SingleTurnEnv, Split, TeacherHabits, split_of


def add_without_carry(a: int, b: int) -> int:
    """Digit-wise sum mod 10: what a pupil who forgets to carry writes (57+68 -> 15)."""
    digits, place = 0, 1
    while a or b:
        digits += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return digits


def teacher_answer(problem: Problem, rng: random.Random, carry_drop: float, zero_pad: float = 0.0) -> str:
    """The warm-start teacher, with two habits the exact-match reward punishes and RL must unlearn:
    on a sum it forgets the carries with probability `carry_drop`, and it zero-pads an answer to
    the widest possible result ("028" for 28) with probability `zero_pad`."""
    answer = problem.answer
    if "+" in problem.text and rng.random() < carry_drop:
        a, b = (int(x) for x in problem.text.rstrip("=").split("+"))
        answer = str(add_without_carry(a, b))
    if rng.random() < zero_pad and not answer.startswith("-"):
        width = max(len(operand) for operand in re.split(r"[-+*=]", problem.text)) + 1
        answer = answer.zfill(width)
    return answer


INTEGER = re.compile(r"-?\d+")


class Arithmetic(SingleTurnEnv):
    name = "arithmetic"

    def __init__(
        self, num_digits: int = 3, operations: str = "+-", prompt_format: Literal["raw", "chat"] = "raw"
    ) -> None:
        if not operations or set(operations) - set("+-*"):
            raise ValueError(f"operations must be a non-empty subset of '+-*', got {operations!r}")
        if prompt_format not in ("raw", "chat"):
            raise ValueError(f"prompt_format must be 'raw' or 'chat', got {prompt_format!r}")
        self.num_digits = num_digits
        self.operations = operations
        self.prompt_format = prompt_format

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(1, self.num_digits)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)

    def problem(self, seed: int, split: Split) -> Problem:
        # Seeds of the two splits draw from separate streams; rejection keeps each problem in the
        # split its hash assigns (about 1 draw in 10 for eval, 1.1 for train).
        rng = random.Random(f"{self.name}:{split}:{seed}")
        while True:
            a, b = self._operand(rng), self._operand(rng)
            op = rng.choice(self.operations)
            prompt = f"{a}{op}{b}="
            if split_of(prompt) == split:  # the same split for a problem in either format
                answer = str({"+": a + b, "-": a - b, "*": a * b}[op])
                if self.prompt_format == "chat":
                    question = ({"role": "user", "content": f"What is {a} {op} {b}?"},)
                    return Problem(seed=seed, split=split, prompt=question, answer=answer)
                return Problem(seed=seed, split=split, prompt=prompt, answer=answer)

    def score(self, problem: Problem, completion: str) -> float:
        if self.prompt_format == "chat":
            # The last integer of the reply: "7 + 5 = 12." is right, "12, no 13" is not.
            numbers = INTEGER.findall(completion)
            return 1.0 if numbers and numbers[-1] == problem.answer else 0.0
        return 1.0 if completion.strip() == problem.answer else 0.0

    def demonstration(self, problem: Problem, rng: random.Random, teacher: TeacherHabits) -> list[str]:
        """The warm-start teacher's assistant turn (see `teacher_answer`)."""
        return [teacher_answer(problem, rng, teacher.carry_drop, teacher.zero_pad)]
