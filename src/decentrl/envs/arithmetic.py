"""Procedural integer arithmetic: `"317+48="` -> `"365"`, exact-match reward.

Operand sizes are drawn uniformly in 1..num_digits digits, so the task mixes easy (no carry)
and hard (multi-carry, borrow, negative results) problems: a warm-started tiny model gets some
right and many wrong, which is what RL needs. The split of a problem is a hash of its text, so
train and held-out problems are disjoint whatever seeds are used.
"""

from __future__ import annotations

import hashlib
import random

from decentrl.envs.base import Problem, Split

EVAL_BUCKETS = 10  # 1 in 10 problems belongs to the held-out split


def _split_of(prompt: str) -> Split:
    digest = hashlib.blake2b(prompt.encode(), digest_size=4).digest()
    return "eval" if int.from_bytes(digest, "little") % EVAL_BUCKETS == 0 else "train"


class Arithmetic:
    name = "arithmetic"

    def __init__(self, num_digits: int = 3, operations: str = "+-") -> None:
        if not operations or set(operations) - set("+-*"):
            raise ValueError(f"operations must be a non-empty subset of '+-*', got {operations!r}")
        self.num_digits = num_digits
        self.operations = operations

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
            if _split_of(prompt) == split:
                answer = {"+": a + b, "-": a - b, "*": a * b}[op]
                return Problem(seed=seed, split=split, prompt=prompt, answer=str(answer))

    def score(self, problem: Problem, completion: str) -> float:
        return 1.0 if completion.strip() == problem.answer else 0.0
