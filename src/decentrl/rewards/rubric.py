"""A rubric: gates, then a weighted sum of reward functions, built from `[reward]`.

    reward = 0                                   if any gate term scores below its threshold
           = sum(weight_i * score_i)             over the other terms, otherwise

A term of weight 0 is a logged metric. Terms scored by a trusted helper role (a reward model:
`REMOTE_FUNCTIONS`) are not computed here; the coordinator combines them with the local ones
when they arrive (`combine`). Each term's score and diagnostics are returned under its label, so
`/metrics` shows `reward_term{term="math_verify"}` next to the total.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from decentrl.config.rewards import REMOTE_FUNCTIONS, RewardConfig, RewardName, RewardTerm
from decentrl.envs.base import Environment, Problem, Split
from decentrl.envs.registry import load_environment
from decentrl.rewards.base import Sample
from decentrl.rewards.functions import build, text_diagnostics

JUDGED = frozenset({RewardName.JUDGE, RewardName.REWARD_MODEL})


@dataclass(frozen=True)
class ScoreJob:
    """What the coordinator sends to the pool for one rollout (small and picklable)."""

    rollout_id: str
    seed: int
    split: Split
    messages: list[dict]


@dataclass(frozen=True)
class TermScores:
    """What one pool call returns: each local term's score, diagnostics and hack flags."""

    rollout_id: str
    terms: dict[str, float]
    diagnostics: dict[str, float] = field(default_factory=dict)
    flags: tuple[str, ...] = ()


class Rubric:
    def __init__(self, config: RewardConfig, env: Environment) -> None:
        labels = [term.label for term in config.terms]
        if len(set(labels)) != len(labels):
            raise ValueError(
                f"reward terms need distinct names, got {labels}; set `name` on repeated functions"
            )
        self.config = config
        self.env = env
        self.local = [t for t in config.terms if t.function not in REMOTE_FUNCTIONS]
        self.remote = [t for t in config.terms if t.function in REMOTE_FUNCTIONS]
        self.functions = {t.label: build(t.function, t.args) for t in self.local}
        self.judged = any(t.function in JUDGED for t in config.terms)

    def score_local(self, job: ScoreJob) -> TermScores:
        problem: Problem = self.env.problem(job.seed, job.split)
        sample = Sample(self.env, problem, job.messages)
        terms: dict[str, float] = {}
        diagnostics, flags = text_diagnostics(sample, self.judged)
        for label, function in self.functions.items():
            score = function(sample)
            terms[label] = float(score.value)
            diagnostics.update({f"{label}.{key}": float(value) for key, value in score.diagnostics.items()})
            flags += tuple(flag for flag in score.flags if flag not in flags)
        return TermScores(job.rollout_id, terms, diagnostics, flags)

    def combine(self, terms: dict[str, float]) -> float:
        return combine(self.config.terms, terms)


def combine(rubric: list[RewardTerm], terms: dict[str, float]) -> float:
    """The reward from every term's score (local and remote); KeyError if one is missing. The one
    place gates and weights are applied: the pool's tests and the coordinator both call it."""
    total = 0.0
    for term in rubric:
        value = terms[term.label]
        if term.gate is not None:
            if value < term.gate:
                return 0.0
            continue
        total += term.weight * value
    return total


def rubric_scorer(env_name: str, env_args: dict, reward_json: str):
    """The pool's per-process scorer: builds the environment and rubric once, then scores jobs.
    Top-level and built from plain values, so the pool can start it in a fresh process."""
    rubric = Rubric(RewardConfig.model_validate_json(reward_json), load_environment(env_name, **env_args))
    return rubric.score_local
