"""Greedy held-out evaluation on an environment's eval split, multi-turn episodes included."""

from __future__ import annotations

from dataclasses import dataclass

from decentrl.engines.base import InferenceEngine
from decentrl.envs import Environment
from decentrl.envs.base import final_answer
from decentrl.envs.chat import ChatFormat
from decentrl.envs.episode import run_episodes, start
from decentrl.protocol import SamplingParams


@dataclass
class EvalResult:
    accuracy: float
    """Mean reward over the held-out problems (the share solved, for 0/1 rewards)."""
    num_problems: int
    examples: list[tuple[str, str, str]]
    """A few (prompt, expected, got) triples, for a human to look at."""


def evaluate(
    engine: InferenceEngine,
    env: Environment,
    chat: ChatFormat,
    num_problems: int,
    max_new_tokens: int,
    batch_size: int = 256,
) -> EvalResult:
    """Mean reward of greedy episodes on the first `num_problems` held-out problems. `chat` is
    built from the model directory's files (`ChatFormat.from_model_dir`), as on the workers."""
    problems = [env.problem(seed, "eval") for seed in range(num_problems)]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    correct, examples = 0.0, []
    for first in range(0, num_problems, batch_size):
        episodes = [start(env, chat, problem) for problem in problems[first : first + batch_size]]
        run_episodes(engine, env, chat, episodes, sampling, seed=0)
        for episode in episodes:
            correct += env.reward(episode.problem, episode.messages)
            if len(examples) < 5:
                got = " | ".join(str(m["content"]) for m in episode.transcript)
                examples.append(
                    (
                        episode.problem.text,
                        episode.problem.answer,
                        got if env.max_turns > 1 else final_answer(episode.messages),
                    )
                )
    return EvalResult(accuracy=correct / num_problems, num_problems=num_problems, examples=examples)
