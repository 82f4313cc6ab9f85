"""Reward functions the scoring tests configure by import path (`function = "custom"`)."""

from __future__ import annotations

import time

from decentrl.rewards.base import Sample, Score


class Sleepy:
    """Exact match, after sleeping `seconds`: a deliberately slow (or, past the timeout, hung) scorer."""

    def __init__(self, seconds: float = 1.0) -> None:
        self.seconds = seconds

    def __call__(self, sample: Sample) -> Score:
        time.sleep(self.seconds)
        return Score(1.0 if sample.completion.strip() == sample.problem.answer else 0.0)


class PaysForLength:
    """A deliberately hackable reward: longer answers score more, right or wrong."""

    def __call__(self, sample: Sample) -> Score:
        return Score(min(len(sample.completion) / 8, 1.0))
