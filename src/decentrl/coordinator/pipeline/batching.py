"""Trainer batches: ready groups out, acknowledgements in, step metrics stored.

A batch is issued once and re-delivered until acked, so a trainer that crashes after fetching a
batch gets the same groups again; a trainer that fetches its next batch while the previous one's
version is still being published names the batches it holds, which are then not re-delivered. Groups that became too stale for the trainer's version are
expired (an event each) and reported in the next batch's `num_groups_expired`, never dropped
silently. Each issued rollout records its staleness for the statistics.
"""

from __future__ import annotations

import json
import secrets
import sqlite3

from decentrl.coordinator.context import Context
from decentrl.coordinator.db.store import (
    GROUP_EXPIRED,
    GROUP_FILTERED,
    add_event,
    get_meta,
    set_meta,
)
from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.coordinator.pipeline.alarms import run_monitors
from decentrl.dbapi import Connection
from decentrl.monitor import records
from decentrl.protocol import BatchAck, BatchRequest, StepMetrics, TrainBatch, TrainGroup, TrainRollout

UNREPORTED = "expired_unreported"


def _train_rollout(row: sqlite3.Row) -> TrainRollout:
    payload = json.loads(row["payload"])
    return TrainRollout(
        rollout_id=row["rollout_id"],
        worker_id=row["worker_id"],
        prompt_token_ids=payload["prompt_token_ids"],
        segments=payload["segments"],
        finish_reason=payload["finish_reason"],
        reward=row["reward"],
        images=payload.get("images"),
    )


def _load_batch(db: Connection, batch: sqlite3.Row) -> TrainBatch:
    groups = []
    for group_id in json.loads(batch["group_ids"]):
        task = db.execute("SELECT task_id, seed FROM tasks WHERE group_id = ?", (group_id,)).fetchone()
        rows = db.execute("SELECT * FROM rollouts WHERE task_id = ? ORDER BY slot", (task["task_id"],))
        rollouts = [_train_rollout(row) for row in rows]
        # The trainer draws a visual task's images from its seed (sent only then).
        seed = task["seed"] if any(rollout.images for rollout in rollouts) else None
        groups.append(TrainGroup(group_id=group_id, task_id=task["task_id"], rollouts=rollouts, seed=seed))
    return TrainBatch(
        batch_id=batch["batch_id"], groups=groups, num_groups_expired=batch["num_groups_expired"]
    )


def _expire_stale(db: Connection, context: Context, version: int, now: float) -> int:
    """Expire ready groups holding a token older than `version - max_staleness`."""
    oldest = version - context.config.max_staleness
    stale = db.execute(
        "SELECT t.task_id, MIN(r.min_version) AS min_version FROM tasks t"
        " JOIN rollouts r ON r.task_id = t.task_id WHERE t.state = 'ready'"
        " GROUP BY t.task_id HAVING MIN(r.min_version) < ?",
        (oldest,),
    ).fetchall()
    for row in stale:
        db.execute("UPDATE tasks SET state = 'expired' WHERE task_id = ?", (row["task_id"],))
        reason = (
            f"{row['task_id']}: version {row['min_version']} older than {oldest} at trainer version {version}"
        )
        add_event(db, now, GROUP_EXPIRED, None, reason)
    return len(stale)


def _filter_zero_variance(db: Connection, now: float) -> int:
    """DAPO dynamic sampling: ready groups whose rewards are all equal leave the queue as
    'filtered' (an event each), which frees their place under max_pending_groups so the workers
    sample replacements: the batch is refilled with groups that carry a learning signal."""
    flat = db.execute(
        "SELECT t.task_id, MIN(r.reward) AS reward FROM tasks t JOIN rollouts r ON r.task_id = t.task_id"
        " WHERE t.state = 'ready' GROUP BY t.task_id HAVING MIN(r.reward) = MAX(r.reward)"
    ).fetchall()
    for row in flat:
        db.execute("UPDATE tasks SET state = 'filtered' WHERE task_id = ?", (row["task_id"],))
        add_event(db, now, GROUP_FILTERED, None, f"{row['task_id']}: every reward is {row['reward']}")
    return len(flat)


def _issue(db: Connection, request: BatchRequest, tasks: list[sqlite3.Row], now: float) -> sqlite3.Row:
    batch_id = f"b-{secrets.token_hex(8)}"
    expired = int(get_meta(db, UNREPORTED) or 0)
    set_meta(db, UNREPORTED, "0")
    group_ids = [task["group_id"] for task in tasks]
    db.execute(
        "INSERT INTO batches (batch_id, state, group_ids, trainer_version, num_groups_expired, created)"
        " VALUES (?, 'issued', ?, ?, ?, ?)",
        (batch_id, json.dumps(group_ids), request.policy_version, expired, now),
    )
    for task in tasks:
        db.execute(
            "UPDATE tasks SET state = 'batched', batch_id = ? WHERE task_id = ?", (batch_id, task["task_id"])
        )
        db.execute(
            "UPDATE rollouts SET staleness = ? - min_version WHERE task_id = ?",
            (request.policy_version, task["task_id"]),
        )
    return db.execute("SELECT * FROM batches WHERE batch_id = ?", (batch_id,)).fetchone()


def next_batch(context: Context, request: BatchRequest) -> TrainBatch | None:
    """The oldest un-acked batch the trainer does not hold (`request.held`) if there is one, else
    `max_groups` ready groups, else None (nothing yet). A request for more groups than may ever
    be pending is refused: no batch of that size could fill, and the trainer would wait forever."""
    limit = context.config.max_pending_groups
    if request.max_groups > limit:
        raise ApiError(
            422,
            f"a batch of {request.max_groups} groups can never fill: coordinator.max_pending_groups is "
            f"{limit}; set trainer.groups_per_step <= {limit} (or raise the coordinator's limit)",
            Reason.BATCH_TOO_LARGE,
        )
    now = context.clock()
    with context.store.transaction() as db:
        issued = db.execute("SELECT * FROM batches WHERE state = 'issued' ORDER BY seq").fetchall()
        pending = [batch for batch in issued if batch["batch_id"] not in request.held]
        if pending:
            return _load_batch(db, pending[0])
        expired = _expire_stale(db, context, request.policy_version, now)
        set_meta(db, UNREPORTED, str(int(get_meta(db, UNREPORTED) or 0) + expired))
        if request.drop_zero_variance:
            _filter_zero_variance(db, now)
        tasks = db.execute(
            "SELECT task_id, group_id FROM tasks WHERE state = 'ready' ORDER BY seq LIMIT ?",
            (request.max_groups,),
        ).fetchall()
        if len(tasks) < request.max_groups:
            return None
        return _load_batch(db, _issue(db, request, tasks, now))


WORKERS_SEEN_S = 60.0
"""An ack's answer counts the workers seen (a lease asked, rollouts sent) this recently: with none,
the trainer publishes no catch-up patches (`weights/publisher.py`)."""


def ack_batch(context: Context, batch_id: str, ack: BatchAck) -> dict:
    """Mark the batch's groups trained (acking twice is harmless); the answer also counts the
    workers seen in the last `WORKERS_SEEN_S`."""
    now = context.clock()
    with context.store.transaction() as db:
        batch = db.execute("SELECT * FROM batches WHERE batch_id = ?", (batch_id,)).fetchone()
        if batch is None:
            raise ApiError(404, f"unknown batch {batch_id!r}", Reason.UNKNOWN_BATCH)
        if batch["state"] == "issued":
            db.execute(
                "UPDATE batches SET state = 'acked', acked_version = ?, acked = ? WHERE batch_id = ?",
                (ack.policy_version, now, batch_id),
            )
            db.execute("UPDATE tasks SET state = 'trained' WHERE batch_id = ?", (batch_id,))
        groups = len(json.loads(batch["group_ids"]))
        since = now - WORKERS_SEEN_S
        seen = db.execute("SELECT COUNT(*) AS n FROM workers WHERE last_seen >= ?", (since,)).fetchone()["n"]
    return {"batch_id": batch_id, "groups_trained": groups, "workers_seen": seen}


def store_metrics(context: Context, step: StepMetrics) -> list[str]:
    """Store the trainer's step and run the reward-hacking monitors on it; return their new alarms."""
    with context.store.transaction() as db:
        db.execute(
            "INSERT OR REPLACE INTO train_metrics (version, ts, metrics) VALUES (?, ?, ?)",
            (step.policy_version, context.clock(), json.dumps(step.metrics)),
        )
        if "reward_mean" not in step.metrics:  # an evaluation alone (version 0's): no train step
            return []
        # Computed with the policy before the update that produced `policy_version`.
        records.store_rollout_logprobs(db, step.policy_version - 1, step.rollout_logprobs)
        return run_monitors(db, context.run.reward.monitors, step, context.clock())


def metrics_history(db: Connection) -> list[StepMetrics]:
    rows = db.execute("SELECT version, metrics FROM train_metrics ORDER BY version")
    return [StepMetrics(policy_version=row["version"], metrics=json.loads(row["metrics"])) for row in rows]
