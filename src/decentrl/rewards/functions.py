"""Built-in reward functions, one small class each, built by name from a rubric term.

Each takes its `args` as keyword arguments and scores a `Sample`. Every function reports the
answer's length and its repeated-4-gram fraction as diagnostics, so the monitors can see length
and repetition jumps whatever the rubric is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from decentrl.config.rewards import RewardName
from decentrl.envd_wire import SIGNED_REWARD
from decentrl.envs.base import exact_match
from decentrl.envs.mathematics.grading import boxed_contents, grade
from decentrl.rewards.base import RewardFunction, Sample, Score
from decentrl.rewards.patterns import find_hacks


def repetition(text: str, n: int = 4) -> float:
    """Fraction of the text's character n-grams that repeat an earlier one (0 for short texts)."""
    grams = [text[i : i + n] for i in range(len(text) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


class EnvReward:
    """The environment's own trusted reward: its `reward`, the one definition of the task's reward;
    for a served episode, the reward its env server read from the live environment and signed."""

    def __call__(self, sample: Sample) -> Score:
        signed = sample.messages[-1].get(SIGNED_REWARD) if sample.messages else None
        if signed is not None:  # set only by the coordinator's check of the signatures (never sent)
            return Score(float(signed))
        return Score(float(sample.env.reward(sample.problem, sample.messages)))


class ExactMatch:
    """`envs.base.exact_match`, the `exact` reward of a dataset, on any environment's problems."""

    def __call__(self, sample: Sample) -> Score:
        return Score(exact_match(sample.completion, sample.problem.answer))


class MathVerify:
    """The `math` environment's reward (`envs.mathematics.grading.grade`) on any environment's
    problems: one `\\boxed{}` value, symbolically equal to the gold answer."""

    def __call__(self, sample: Sample) -> Score:
        result = grade(sample.completion, sample.problem.answer)
        return Score(result.reward, {"no_box": float(result.reason == "no box")})


class BoxedFormat:
    """1 when the answer holds exactly one `\\boxed{}` (a gate before the value is judged)."""

    def __call__(self, sample: Sample) -> Score:
        return Score(1.0 if len(boxed_contents(sample.completion)) == 1 else 0.0)


class Overlong:
    """DAPO's soft over-length punishment (arXiv 2503.14476, eq. 13), in characters: 0 up to
    `max_chars - buffer_chars`, then linearly down to -1 at `max_chars` and beyond."""

    def __init__(self, max_chars: int = 512, buffer_chars: int = 128) -> None:
        if not 0 < buffer_chars <= max_chars:
            raise ValueError(f"overlong needs 0 < buffer_chars <= max_chars, got {buffer_chars}, {max_chars}")
        self.max_chars = max_chars
        self.buffer_chars = buffer_chars

    def __call__(self, sample: Sample) -> Score:
        excess = len(sample.completion) - (self.max_chars - self.buffer_chars)
        return Score(-min(max(excess, 0) / self.buffer_chars, 1.0))


def _judge(**kwargs: Any) -> RewardFunction:
    from decentrl.rewards.judge import JudgeReward

    return JudgeReward(**kwargs)


def _custom(target: str = "", **kwargs: object) -> RewardFunction:
    """`target` is "module:attribute", imported in the scoring process."""
    import importlib

    module, _, attribute = target.partition(":")
    if not module or not attribute:
        raise ValueError(f"custom reward needs args.target = 'module:attribute', got {target!r}")
    try:
        factory = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"custom reward target {target!r} cannot be imported ({exc})") from None
    return factory(**kwargs)


BUILDERS: dict[RewardName, Callable[..., RewardFunction]] = {
    RewardName.ENV: EnvReward,
    RewardName.EXACT_MATCH: ExactMatch,
    RewardName.MATH_VERIFY: MathVerify,
    RewardName.FORMAT: BoxedFormat,
    RewardName.OVERLONG: Overlong,
    RewardName.JUDGE: _judge,
    RewardName.CUSTOM: _custom,
}


def build(name: RewardName, args: dict) -> RewardFunction:
    """The function `name` built with `args`; a bad argument is a ValueError naming the fix."""
    try:
        return BUILDERS[name](**args)
    except TypeError as exc:
        raise ValueError(f"reward function {name.value!r}: {exc}; check its `args`") from None


def text_diagnostics(sample: Sample, judged: bool) -> tuple[dict[str, float], tuple[str, ...]]:
    """Length and repetition of the answer, and the known hacks it contains."""
    text = sample.completion
    diagnostics = {"answer_chars": float(len(text)), "repetition": repetition(text)}
    return diagnostics, tuple(find_hacks(text, judged=judged))
