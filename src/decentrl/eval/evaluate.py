"""Greedy held-out evaluation on an environment's eval split."""

from __future__ import annotations

from dataclasses import dataclass

from decentrl.engines.base import InferenceEngine
from decentrl.envs import Environment
from decentrl.envs.base import completion_text
from decentrl.protocol import SamplingParams


@dataclass
class EvalResult:
    accuracy: float
    num_problems: int
    examples: list[tuple[str, str, str]]
    """A few (prompt, expected, got) triples, for a human to look at."""


def evaluate(
    engine: InferenceEngine,
    env: Environment,
    tokenizer,
    num_problems: int,
    max_new_tokens: int,
    batch_size: int = 256,
) -> EvalResult:
    problems = [env.problem(seed, "eval") for seed in range(num_problems)]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    correct, examples = 0.0, []
    for start in range(0, num_problems, batch_size):
        chunk = problems[start : start + batch_size]
        completions = engine.generate([tokenizer.encode(p.prompt) for p in chunk], sampling, seed=0)
        for problem, completion in zip(chunk, completions, strict=True):
            text = completion_text(tokenizer, completion.token_ids, {tokenizer.eos_token_id})
            correct += env.score(problem, text)
            if len(examples) < 5:
                examples.append((problem.prompt, problem.answer, text))
    return EvalResult(accuracy=correct / num_problems, num_problems=num_problems, examples=examples)
