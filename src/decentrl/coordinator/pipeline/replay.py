"""Replay each submitted episode before ingestion takes the lock: the messages the reward reads.

The coordinator never uses a worker's reward, nor its environment turns. It rebuilds the problem
from the task's seed and replays the episode from the submitted token ids, re-running every
deterministic environment turn (tool calls, observations); ingestion rejects a rollout whose
environment turns differ from the replay (the worker's fault, refused at once). A served task's
episodes are not re-run: their env server's signed turns answer the replay instead (`served.py`).
The replayed messages are what the rubric scores, later and in the scoring pool (`scoring.py`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from decentrl.coordinator.context import Context
from decentrl.coordinator.env_servers import granted_episodes
from decentrl.coordinator.http.errors import Reason
from decentrl.coordinator.pipeline.served import Refused, check_served
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


def _granted(context: Context, rollouts: list[Rollout]) -> dict[str, dict]:
    """The episodes the coordinator granted that a served submission's rollouts name."""
    names = [r.served.end.episode_id for r in rollouts if r.served is not None]
    with context.store.transaction() as db:
        return granted_episodes(db, names)


def check_one(context: Context, seed: int, rollout: Rollout, granted: dict[str, dict]) -> Replayed:
    """A served rollout's signed turns checked in place of a replay (`served.py`)."""
    episode = None if rollout.served is None else granted.get(rollout.served.end.episode_id)
    try:
        return Replayed(seed, check_served(context, seed, rollout, episode))
    except Refused as refused:
        return Replayed(seed, None, str(refused), refused.reason)
    except (RecursionError, ValueError, OverflowError, TypeError, KeyError) as exc:
        log.warning("rollout %s of task %s cannot be checked: %r", rollout.slot, rollout.task_id, exc)
        return Replayed(
            seed, None, f"the served episode cannot be checked ({type(exc).__name__})", Reason.UNSCORABLE
        )


def replay_one(context: Context, seed: int, rollout: Rollout) -> Replayed:
    """Replay one rollout of the task with `seed`."""
    if rollout.served is not None:
        return Replayed(
            seed, None, "signed env turns in a run whose task is not served", Reason.ENV_SIGNATURE
        )
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
    granted = _granted(context, rollouts) if context.run.task.served else None
    return [
        (
            replay_one(context, seeds[r.task_id], r)
            if granted is None
            else check_one(context, seeds[r.task_id], r, granted)
        )
        if r.task_id in seeds and _in_vocabulary(context, r)
        else Replayed()
        for r in rollouts
    ]
