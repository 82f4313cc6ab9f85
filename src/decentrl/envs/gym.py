"""`GymEnvironment`: wrap an environment written gym-style (`reset` / `step`) into the interface.

The wrapped object needs `reset(seed) -> (observation: str, info)` and `step(action: str) ->
(observation: str, reward: float, terminated: bool, truncated: bool, info)`, as in Gymnasium, GEM
or SkyRL-gym text environments. Each model turn is one action; each observation is a user turn.
`respond` and `reward` replay the actions from a fresh `reset(seed)` (gym envs keep hidden state,
and the coordinator must rebuild it from the token ids alone), so `step` must be deterministic
given the seed and the actions. The episode's reward is the sum of step rewards, clipped to [0, 1].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from decentrl.envs.base import Message, Problem, Split

SPLIT_OFFSET = {"train": 0, "eval": 1 << 40}  # disjoint seed ranges for the two splits


class GymLike(Protocol):
    def reset(self, seed: int) -> tuple[str, Any]: ...

    def step(self, action: str) -> tuple[str, float, bool, bool, Any]: ...


class GymEnvironment:
    def __init__(self, make: Callable[[], GymLike], name: str = "gym", max_turns: int = 8):
        self.make = make
        self.name = name
        self.max_turns = max_turns
        self.tools: list[dict] = []

    def problem(self, seed: int, split: Split) -> Problem:
        observation, _ = self.make().reset(seed=seed + SPLIT_OFFSET[split])
        return Problem(seed=seed, split=split, prompt=({"role": "user", "content": observation},), answer="")

    def _replay(self, problem: Problem, messages: list[Message]) -> tuple[str, float, bool]:
        env = self.make()
        env.reset(seed=problem.seed + SPLIT_OFFSET[problem.split])
        observation, total, done = "", 0.0, False
        for message in messages:
            if message["role"] != "assistant":
                continue
            assert not done, "an action after the end of a gym episode"
            observation, reward, terminated, truncated, _ = env.step(str(message["content"]))
            total += float(reward)
            done = terminated or truncated
        return observation, total, done

    def respond(self, problem: Problem, messages: list[Message]) -> list[Message] | None:
        observation, _, done = self._replay(problem, messages)
        return None if done else [{"role": "user", "content": observation}]

    def reward(self, problem: Problem, messages: list[Message]) -> float:
        return min(1.0, max(0.0, self._replay(problem, messages)[1]))
