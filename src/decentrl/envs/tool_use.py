"""`tool_use`: look up a code in a procedurally generated registry; needs a tool call to succeed.

The registry maps every consonant-vowel-consonant-vowel name ("kibo") to a random 4-digit code,
drawn from `corpus_seed`. A problem asks for the code of one name; the model can only learn it by
calling `lookup(name)` (train and held-out names are disjoint, so memorising train codes does not
help), and the reward also demands at least one successful call. The warm-start teacher gives up
("?") without calling the tool in a fraction `sft.teacher_skip_tool` of its demonstrations: the
habit RL has to unlearn.
"""

from __future__ import annotations

import itertools
import random

from decentrl.envs.base import Message, Problem, Split, TeacherHabits, final_answer, split_of
from decentrl.envs.tool_env import ToolEnv
from decentrl.envs.toolcalls import ToolCall, ToolFormatName

CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"
GIVE_UP = "?"


class ToolUse(ToolEnv):
    name = "tool_use"

    def __init__(self, corpus_seed: int = 0, tool_format: ToolFormatName = "python", max_turns: int = 3):
        rng = random.Random(f"tool_use-corpus:{corpus_seed}")
        names = ["".join(p) for p in itertools.product(CONSONANTS, VOWELS, CONSONANTS, VOWELS)]
        self.registry = {name: f"{rng.randrange(10_000):04d}" for name in names}
        self.names: dict[Split, list[str]] = {"train": [], "eval": []}
        for name in names:
            self.names[split_of(name)].append(name)
        super().__init__([self.lookup], tool_format=tool_format, max_turns=max_turns)

    def lookup(self, name: str) -> str:
        """Look up the code registered under a name.

        Args:
            name: the registered name, lower case.
        """
        return self.registry.get(name, "not found")

    def problem(self, seed: int, split: Split) -> Problem:
        name = random.Random(f"{self.name}:{split}:{seed}").choice(self.names[split])
        prompt = ({"role": "user", "content": f"code of {name}?"},)
        return Problem(seed=seed, split=split, prompt=prompt, answer=self.registry[name], info={"name": name})

    def reward(self, problem: Problem, messages: list[Message]) -> float:
        called = problem.answer in self.tool_results(messages)
        return 1.0 if called and final_answer(messages).strip() == problem.answer else 0.0

    def demonstration(self, problem: Problem, rng: random.Random, teacher: TeacherHabits) -> list[str]:
        """The warm-start teacher's assistant turns: call the tool, then copy its answer; or give up."""
        if rng.random() < teacher.skip_tool:
            return [GIVE_UP]
        call = self.tool_format.render(ToolCall("lookup", [problem.info["name"]]))
        return [call, problem.answer]
