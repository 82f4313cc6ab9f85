"""What a reward function is: a scored sample in, a score with named diagnostics out.

A reward function sees the problem (seed, prompt, gold answer, hidden info), the episode's chat
messages (assistant turns decoded from the worker's token ids, environment turns replayed on the
coordinator) and the environment that made both. It returns a `Score`: the value, named
diagnostics that reach `/metrics`, and the names of any known reward-hacking patterns it saw
(`rewards/patterns.py`), which the monitors count and `reward.zero_flagged` can zero.

Functions run inside the scoring pool's processes (`rewards/pool.py`), never on a coordinator
thread, so they may block, use `signal.alarm` (math-verify does) or call out over HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from decentrl.envs.base import Environment, Message, Problem, final_answer


@dataclass(frozen=True)
class Sample:
    """One finished episode to score."""

    env: Environment
    problem: Problem
    messages: list[Message]

    @property
    def completion(self) -> str:
        """The last assistant turn (what single-turn rewards judge)."""
        return final_answer(self.messages)


@dataclass(frozen=True)
class Score:
    value: float
    diagnostics: Mapping[str, float] = field(default_factory=dict)
    """Named numbers about this score (answer length, judge retries, ...); averaged on /metrics."""
    flags: tuple[str, ...] = ()
    """Known reward-hacking patterns seen in the sample (`rewards.patterns.Hack` values)."""


class RewardFunction(Protocol):
    def __call__(self, sample: Sample) -> Score: ...
