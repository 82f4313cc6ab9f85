"""Environment interface (single-turn for now; multi-turn episodes arrive with the agentic issue).

An environment makes problems from integer seeds, deterministically, with disjoint train and
held-out splits, and scores a completion. Scoring runs on the coordinator from the token ids it
received, never from a worker's claim.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal, Protocol

Split = Literal["train", "eval"]


@dataclass(frozen=True)
class Problem:
    seed: int
    split: Split
    prompt: str
    answer: str


class Environment(Protocol):
    name: str

    def problem(self, seed: int, split: Split) -> Problem:
        """The problem of `seed` in `split`; the same arguments always give the same problem."""
        ...

    def score(self, problem: Problem, completion: str) -> float:
        """Reward in [0, 1] for `completion` (the decoded model tokens, EOS stripped)."""
        ...


def completion_text(tokenizer, token_ids: list[int], eos_token_ids: Collection[int]) -> str:
    """The text an environment scores: the model tokens minus one final EOS, special tokens kept
    (skipping them would let `3<pad>65` score as `365`). Used by the coordinator's trusted reward
    and by evaluation, so both score exactly alike."""
    if token_ids and token_ids[-1] in eos_token_ids:
        token_ids = token_ids[:-1]
    return tokenizer.decode(token_ids, skip_special_tokens=False)
