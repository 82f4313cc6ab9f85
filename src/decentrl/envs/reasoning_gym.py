"""`reasoning_gym`: procedural tasks of the `reasoning-gym` package (pinned 0.1.25, extra `envs`).

Each problem is one generated item of the chosen task, drawn deterministically from the seed;
train and held-out items are split by a hash of the question, so the splits are disjoint.

Scoring is exact. reasoning-gym's default `score_answer` gives partial credit when the gold
answer is a substring of the answer (`len(gold) / len(answer)`: "-4" inside " -4 " scores 0.5),
which rewards padding and enumeration, and some custom
verifiers accept trailing junk. Here an answer earns 1 only when, stripped of surrounding
whitespace, it equals the gold answer (tasks with several right answers: when their own verifier
gives full marks), and 0 otherwise.
"""

from __future__ import annotations

import hashlib
import random
from functools import lru_cache
from typing import Any, Literal

from decentrl.envs.base import Problem, SingleTurnEnv, Split, TeacherHabits, split_of

# Tasks checked by tests/unit/test_reasoning_gym.py: deterministic, gold answers score 1 and
# padded or wrong ones 0 under exact scoring, questions short enough for small models.
TASKS = (
    "basic_arithmetic",
    "base_conversion",
    "bitwise_arithmetic",
    "caesar_cipher",
    "chain_sum",
    "count_bits",
    "count_primes",
    "decimal_arithmetic",
    "fraction_simplification",
    "gcd",
    "gsm_symbolic",
    "lcm",
    "leg_counting",
    "letter_counting",
    "letter_jumble",
    "number_filtering",
    "number_sorting",
    "palindrome_generation",
    "power_function",
    "prime_factorization",
    "products",
    "simple_equations",
    "spell_backward",
    "word_sequence_reversal",
    "word_sorting",
)
# Tasks with several right answers keep their own verifier (binarised at full marks). Everywhere
# else the answer must equal the gold one: some verifiers forgive trailing junk ("12 0" for "12").
MANY_ANSWERS = frozenset({"palindrome_generation"})
BLOCK = 1000  # items per generated dataset (each a lazily indexed, seeded generator)
ATTEMPTS = 256  # draws per problem to land in the wanted split (a miss has probability 0.9^256)


@lru_cache(maxsize=64)
def _dataset(task: str, settings: str, seed: int) -> Any:
    import json

    import reasoning_gym

    return reasoning_gym.create_dataset(task, seed=seed, size=BLOCK, **json.loads(settings))


class ReasoningGym(SingleTurnEnv):
    def __init__(
        self,
        task: str = "basic_arithmetic",
        prompt_format: Literal["chat", "raw"] = "chat",
        settings: dict | None = None,
    ) -> None:
        if task not in TASKS:
            raise ValueError(
                f"reasoning_gym task {task!r} is not supported; choose one of {', '.join(TASKS)}"
            )
        try:
            import reasoning_gym  # noqa: F401
        except ImportError:
            raise ValueError("reasoning_gym needs its package: pip install 'decentrl[envs]'") from None
        import json

        self.task = task
        self.name = "reasoning_gym"
        self.prompt_format = prompt_format
        self.settings = json.dumps(settings or {}, sort_keys=True)

    def _entry(self, key: int, split: Split) -> dict:
        block, index = divmod(key, BLOCK)
        digest = hashlib.blake2b(
            f"{self.task}:{self.settings}:{split}:{block}".encode(), digest_size=4
        ).digest()
        return _dataset(self.task, self.settings, int.from_bytes(digest, "little"))[index]

    def problem(self, seed: int, split: Split) -> Problem:
        for attempt in range(ATTEMPTS):
            entry = self._entry(seed * ATTEMPTS + attempt, split)
            if split_of(entry["question"]) == split:
                break
        else:
            raise AssertionError(f"no {split} item for seed {seed} of {self.task}")
        question = entry["question"]
        prompt = question if self.prompt_format == "raw" else ({"role": "user", "content": question},)
        return Problem(
            seed=seed, split=split, prompt=prompt, answer=str(entry["answer"]), info={"entry": entry}
        )

    def score(self, problem: Problem, completion: str) -> float:
        answer = completion.strip()
        if self.task not in MANY_ANSWERS:
            return 1.0 if answer == problem.answer else 0.0
        dataset = _dataset(self.task, self.settings, 0)
        try:
            full_marks = dataset.score_answer(answer=answer, entry=problem.info["entry"]) >= 1.0
        except Exception:  # noqa: BLE001 - a task's verifier choking on a model's answer scores 0
            full_marks = False
        return 1.0 if full_marks else 0.0

    def demonstration(self, problem: Problem, rng: random.Random, teacher: TeacherHabits) -> list[str]:
        return [problem.answer]
