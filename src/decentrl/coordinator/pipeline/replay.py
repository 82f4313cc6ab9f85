"""Replay each submitted episode before ingestion takes the lock: the messages the reward reads.

The coordinator never uses a worker's reward, nor its environment turns. It rebuilds the problem
from the task's seed and replays the episode from the submitted token ids, re-running every
deterministic environment turn (tool calls, observations); ingestion rejects a rollout whose
environment turns differ from the replay (the worker's fault, refused at once). The replayed
messages are what the rubric scores, later and in the scoring pool (`scoring.py`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from decentrl.coordinator.context import Context
from decentrl.coordinator.http.errors import Reason
from decentrl.envs.episode import ReplayMismatch, replay
from decentrl.protocol import Rollout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replayed:
    seed: int | None = None
    messages: list[dict] | None = None
    """The episode's chat messages; None when the rollout was not replayed (ingestion rejects it
    anyway) or its replay failed (`mismatch` says why)."""
    mismatch: str | None = None
    reason: Reason = Reason.ENV_MISMATCH
    """`env_mismatch` (the replay differs) or `unscorable` (the environment raised on the content)."""


def _task_seeds(context: Context, task_ids: set[str]) -> dict[str, int]:
    with context.store.transaction() as db:
        marks = ",".join("?" * len(task_ids))
        rows = db.execute(f"SELECT task_id, seed FROM tasks WHERE task_id IN ({marks})", tuple(task_ids))
        return {row["task_id"]: row["seed"] for row in rows}


def _in_vocabulary(context: Context, rollout: Rollout) -> bool:
    return all(0 <= t < context.model.vocab_size for s in rollout.segments for t in s.token_ids)


def replay_one(context: Context, seed: int, rollout: Rollout) -> Replayed:
    """Replay one rollout of the task with `seed`."""
    problem = context.env.problem(seed, "train")
    try:
        episode = replay(
            context.env,
            context.chat,
            problem,
            rollout.segments,
            context.config.max_new_tokens,
            context.model.max_context,
        )
    except ReplayMismatch as exc:
        return Replayed(seed, None, f"environment replay: {exc}")
    except (RecursionError, ValueError, OverflowError, TypeError, KeyError) as exc:
        # Hostile content can make a parser give up (brackets nested thousands deep, an integer of
        # thousands of digits): that is the submitter's doing, a 422 with a strike, not a 500.
        log.warning("rollout %s of task %s cannot be replayed: %r", rollout.slot, rollout.task_id, exc)
        detail = f"the environment cannot replay this completion ({type(exc).__name__})"
        return Replayed(seed, None, detail, Reason.UNSCORABLE)
    return Replayed(seed, episode.messages)


def replay_rollouts(context: Context, rollouts: list[Rollout]) -> list[Replayed]:
    """One `Replayed` per rollout; rollouts that ingestion will reject anyway (unknown task, ids
    outside the vocabulary) are not replayed."""
    seeds = _task_seeds(context, {r.task_id for r in rollouts})
    return [
        replay_one(context, seeds[r.task_id], r)
        if r.task_id in seeds and _in_vocabulary(context, r)
        else Replayed()
        for r in rollouts
    ]
