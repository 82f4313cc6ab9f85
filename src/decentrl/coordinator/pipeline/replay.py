"""Trusted rewards: replay each submitted episode and score it, before ingestion takes the lock.

The coordinator never uses a worker's reward. It rebuilds the problem from the task's seed,
replays the episode from the submitted token ids (re-running every deterministic environment
turn: tool calls, observations) and lets the environment score the replayed messages; code tasks
re-execute the final code against their hidden tests in the coordinator's own sandbox. Scoring
can be slow, so it runs here, outside the store's lock; ingestion then checks everything else
under the lock and rejects a rollout whose environment turns differ from the replay.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from decentrl.coordinator.context import Context
from decentrl.envs.episode import ReplayMismatch, replay
from decentrl.protocol import Rollout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scored:
    reward: float | None
    """None when the rollout could not be scored; `mismatch` says why when it is the worker's fault."""
    mismatch: str | None = None


def _task_seeds(context: Context, task_ids: set[str]) -> dict[str, int]:
    with context.store.transaction() as db:
        marks = ",".join("?" * len(task_ids))
        rows = db.execute(f"SELECT task_id, seed FROM tasks WHERE task_id IN ({marks})", tuple(task_ids))
        return {row["task_id"]: row["seed"] for row in rows}


def _in_vocabulary(context: Context, rollout: Rollout) -> bool:
    return all(0 <= t < context.model.vocab_size for s in rollout.segments for t in s.token_ids)


def score(context: Context, seed: int, rollout: Rollout) -> Scored:
    """Replay one rollout of the task with `seed` and score it."""
    problem = context.env.problem(seed, "train")
    try:
        episode = replay(context.env, context.chat, problem, rollout.segments, context.config.max_new_tokens)
    except ReplayMismatch as exc:
        return Scored(None, f"environment replay: {exc}")
    return Scored(float(context.env.reward(problem, episode.messages)))


def score_rollouts(context: Context, rollouts: list[Rollout]) -> list[Scored]:
    """One `Scored` per rollout; rollouts that ingestion will reject anyway (unknown task, ids
    outside the vocabulary) are not scored."""
    seeds = _task_seeds(context, {r.task_id for r in rollouts})
    return [
        score(context, seeds[r.task_id], r)
        if r.task_id in seeds and _in_vocabulary(context, r)
        else Scored(None)
        for r in rollouts
    ]
