"""Held-out evaluation on an environment's eval split, multi-turn episodes included.

One function serves `decentrl eval`, the demo's before/after numbers and the trainer's periodic
evaluation: greedy pass@1 on the first `num_problems` held-out problems and, with
`num_samples` = k > 0, k sampled episodes per problem for pass@k and avg@k (eval/scores.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from decentrl.engines.base import InferenceEngine
from decentrl.envs import Environment
from decentrl.envs.base import Problem, final_answer
from decentrl.envs.chat import ChatFormat
from decentrl.envs.episode import Episode, run_episodes, start
from decentrl.eval.scores import Score, mean_interval, pass_at_k, wilson
from decentrl.protocol import SamplingParams

log = logging.getLogger("decentrl.eval")

CORRECT = 1.0
"""Reward of a solved problem: pass@k counts samples at this reward (partial credit is avg@k's)."""


@dataclass
class EvalResult:
    accuracy: float
    """Greedy pass@1: mean reward of one greedy episode per problem (the share solved, for 0/1 rewards)."""
    num_problems: int
    examples: list[tuple[str, str, str]]
    """A few (prompt, expected, got) triples of greedy episodes, for a human to look at."""
    greedy: Score
    num_samples: int = 0
    """k: sampled episodes per problem (0 = greedy only)."""
    pass_at_k: Score | None = None
    avg_at_k: Score | None = None
    answers: list[dict] = field(default_factory=list)
    """Every greedy episode: problem index, prompt, expected answer, reply, reward and why it
    stopped (`decentrl eval --answers` writes them, one JSON line each)."""

    @property
    def finished(self) -> list[dict]:
        """The greedy answers that ended on their own (`finished`, see `_answer`)."""
        return [a for a in self.answers if a["finished"]]

    @property
    def finished_share(self) -> float:
        return len(self.finished) / len(self.answers) if self.answers else 0.0

    @property
    def accuracy_when_finished(self) -> float | None:
        """Greedy accuracy among finished answers: a gain here is more than learning to stop in
        time (None when no answer finished)."""
        done = self.finished
        return sum(a["reward"] for a in done) / len(done) if done else None

    def format_scores(self, confidence: float) -> dict[str, Score]:
        """`finished` (the share of greedy answers that ended on their own) and, when any did,
        `pass@1_greedy_finished` (accuracy among them), each with its interval."""
        scores = {"finished": wilson(len(self.finished), len(self.answers), confidence)}
        if self.finished:
            scores["pass@1_greedy_finished"] = greedy_score([a["reward"] for a in self.finished], confidence)
        return scores


def greedy_score(rewards: list[float], confidence: float) -> Score:
    """The mean of one greedy reward per problem: a Wilson interval for 0/1 rewards, else a normal
    interval over problems."""
    if all(r in (0.0, CORRECT) for r in rewards):
        return wilson(sum(rewards), len(rewards), confidence)
    return mean_interval(rewards, confidence)


def _play(
    engine: InferenceEngine,
    env: Environment,
    chat: ChatFormat,
    problems: list[Problem],
    sampling: SamplingParams,
    batch_size: int,
    seed: int,
    progress: str | None = None,
) -> list[Episode]:
    """Every problem's episode, `batch_size` at a time; with `progress`, a line per batch saying
    how far it is and how long the rest should take."""
    episodes = []
    started = time.monotonic()
    for index, first in enumerate(range(0, len(problems), batch_size)):
        batch = [start(env, chat, problem) for problem in problems[first : first + batch_size]]
        # Distinct seeds per batch (and per turn inside run_episodes) keep samples independent.
        run_episodes(engine, env, chat, batch, sampling, seed=seed + 1000 * index)
        episodes += batch
        if progress:
            elapsed = time.monotonic() - started
            left = elapsed / len(episodes) * (len(problems) - len(episodes))
            log.info(
                "%s: %d/%d episodes in %.0f s, about %.0f s left",
                progress,
                len(episodes),
                len(problems),
                elapsed,
                left,
            )
    return episodes


def _example(env: Environment, episode: Episode) -> tuple[str, str, str]:
    got = " | ".join(str(m["content"]) for m in episode.transcript)
    return (
        episode.problem.text,
        episode.problem.answer,
        got if env.max_turns > 1 else final_answer(episode.messages),
    )


def _answer(env: Environment, index: int, episode: Episode, reward: float) -> dict:
    """One greedy episode as `--answers` writes it. `finished`: the model ended it with an
    end-of-turn token and asked for no further turn; a single-turn episode's one turn ending so is
    stopped as `max_turns`, a multi-turn episode that used every turn is not finished."""
    prompt, expected, reply = _example(env, episode)
    finished = episode.stop == "final_answer" or (episode.stop == "max_turns" and env.max_turns == 1)
    return {
        "index": index,
        "prompt": prompt,
        "expected": expected,
        "reply": reply,
        "reward": reward,
        "stop": episode.stop,
        "finished": finished,
        "model_tokens": episode.num_model_tokens,
    }


def evaluate(
    engine: InferenceEngine,
    env: Environment,
    chat: ChatFormat,
    num_problems: int,
    max_new_tokens: int,
    batch_size: int = 256,
    num_samples: int = 0,
    temperature: float = 1.0,
    confidence: float = 0.95,
    seed: int = 0,
    max_context: int | None = None,
    progress: str | None = None,
) -> EvalResult:
    """Greedy pass@1 and, with `num_samples` > 0, pass@k and avg@k at `temperature`. `chat` is
    built from the model directory's files (`ChatFormat.from_model_dir`), as on the workers;
    `max_context` bounds multi-turn episodes as the run's leases do (`SamplingParams.max_context`);
    with `progress` (a label) every batch logs how far the evaluation is."""
    problems = [env.problem(index, "eval") for index in range(num_problems)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, max_context=max_context)
    episodes = _play(
        engine, env, chat, problems, greedy, batch_size, seed, progress and f"{progress}, greedy"
    )
    rewards = [env.reward(e.problem, e.messages) for e in episodes]
    result = EvalResult(
        accuracy=sum(rewards) / num_problems,
        num_problems=num_problems,
        examples=[_example(env, e) for e in episodes[:5]],
        greedy=greedy_score(rewards, confidence),
        num_samples=num_samples,
        answers=[_answer(env, i, e, r) for i, (e, r) in enumerate(zip(episodes, rewards, strict=True))],
    )
    if num_samples == 0:
        return result
    sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, max_context=max_context)
    repeated = [problem for problem in problems for _ in range(num_samples)]
    sampled = _play(
        engine,
        env,
        chat,
        repeated,
        sampling,
        batch_size,
        seed + 1,
        progress and f"{progress}, {num_samples} samples",
    )
    per_problem = [
        [env.reward(e.problem, e.messages) for e in sampled[i * num_samples : (i + 1) * num_samples]]
        for i in range(num_problems)
    ]
    result.pass_at_k = mean_interval(
        [pass_at_k(num_samples, sum(r == CORRECT for r in rs), num_samples) for rs in per_problem],
        confidence,
    )
    result.avg_at_k = mean_interval([sum(rs) / num_samples for rs in per_problem], confidence)
    return result
