"""The reward-hacking monitors on the coordinator: run at every trainer step, recorded as alarms.

When the trainer reports a step (`POST /v1/trainer/metrics`), the step's train reward (the
trainer's `reward_mean`), the mean answer length and repetition of the rollouts scored since the
previous report, and the held-out accuracy when the trainer evaluated, are stored in `reward_steps`.
The monitors of `rewards/monitors.py` then run over that history, and `rewards/outliers.py` over
the groups of the most recent scored rollouts, and a check of DAPO's dynamic sampling over the
groups that finished in the last `window` steps; each new alarm is an event (`/v1/stats`,
Prometheus), a row with its detail, a warning here and a line in the trainer's log (the alarms
come back in the answer to the trainer's post).
An alarm of one kind (and one worker) fires at most once per `monitors.window` steps.
"""

from __future__ import annotations

import json
from collections import defaultdict

from decentrl.config.rewards import RewardMonitorConfig
from decentrl.coordinator.db.store import GROUP_FILTERED, get_meta, set_meta
from decentrl.coordinator.pipeline.scoring import record_alarm
from decentrl.dbapi import Connection
from decentrl.protocol import StepMetrics
from decentrl.rewards.monitors import Alarm, StepStats, groups_filtered, jumps, reward_without_heldout
from decentrl.rewards.outliers import GroupReward, worker_outliers

PEER_WINDOW_ROLLOUTS = 4000  # the workers' comparison uses this many most recent scored rollouts
OUTLIERS_KEY = "reward_outliers"  # meta: the workers flagged as outliers and not yet back among peers


def _text_stats(db: Connection, after: int) -> tuple[float, float] | None:
    rows = db.execute(
        "SELECT diagnostics FROM reward_scores WHERE seq > ? AND failure IS NULL", (after,)
    ).fetchall()
    values = [json.loads(row["diagnostics"]) for row in rows]
    values = [v for v in values if "answer_chars" in v]
    if not values:
        return None
    count = len(values)
    return sum(v["answer_chars"] for v in values) / count, sum(v["repetition"] for v in values) / count


def _record_step(db: Connection, step: StepMetrics, now: float) -> None:
    previous = db.execute(
        "SELECT last_score, answer_chars, repetition FROM reward_steps ORDER BY version DESC LIMIT 1"
    ).fetchone()
    # The step's answers: rollouts scored since the previous step (by row order, not clock).
    text = _text_stats(db, previous["last_score"] if previous else 0)
    if text is None:  # nothing new was scored: carry the last values forward
        text = (previous["answer_chars"], previous["repetition"]) if previous else (0.0, 0.0)
    last_score = db.execute("SELECT COALESCE(MAX(seq), 0) FROM reward_scores").fetchone()[0]
    db.execute(
        "INSERT OR REPLACE INTO reward_steps (version, ts, last_score, reward, answer_chars, repetition,"
        " heldout) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (
            step.policy_version,
            now,
            last_score,
            step.metrics.get("reward_mean", 0.0),
            text[0],
            text[1],
            step.metrics.get("eval_accuracy"),
        ),
    )


def _history(db: Connection) -> list[StepStats]:
    rows = db.execute("SELECT * FROM reward_steps ORDER BY version").fetchall()
    return [
        StepStats(r["version"], r["reward"], r["answer_chars"], r["repetition"], r["heldout"]) for r in rows
    ]


def _groups(db: Connection) -> list[GroupReward]:
    """The groups of the most recent scored rollouts, each with its worker and policy version."""
    rows = db.execute(
        "SELECT r.task_id, r.worker_id, r.min_version, s.reward FROM"
        " (SELECT rollout_id, reward FROM reward_scores ORDER BY seq DESC LIMIT ?) AS s"
        " JOIN rollouts r ON r.rollout_id = s.rollout_id",
        (PEER_WINDOW_ROLLOUTS,),
    ).fetchall()
    # A unit is one group's rollouts from one worker (a group whose lease expired may be finished
    # by another worker: each part counts for its own worker).
    versions: dict[tuple[str, str], int] = {}
    rewards: dict[tuple[str, str], list[float]] = defaultdict(list)
    for row in rows:
        unit = (row["task_id"], row["worker_id"])
        versions[unit] = min(row["min_version"], versions.get(unit, row["min_version"]))
        rewards[unit].append(row["reward"])
    return [GroupReward(unit[1], versions[unit], sum(rs) / len(rs)) for unit, rs in rewards.items()]


def _outliers(db: Connection, config: RewardMonitorConfig) -> list[tuple[str, str]]:
    """New outliers; the flagged set (hysteresis) lives in `meta`, shared by every replica."""
    flagged = json.loads(get_meta(db, OUTLIERS_KEY) or "[]")
    alarms, still = worker_outliers(_groups(db), config, flagged)
    if still != set(flagged):
        set_meta(db, OUTLIERS_KEY, json.dumps(sorted(still)))
    return alarms


def _dynamic_sampling(db: Connection, version: int, window: int) -> tuple[int, int]:
    """Groups that dynamic sampling dropped, and groups issued to the trainer, since the step
    `window` versions before `version` (since the start before that)."""
    row = db.execute(
        "SELECT ts FROM reward_steps WHERE version <= ? ORDER BY version DESC LIMIT 1", (version - window,)
    ).fetchone()
    since = row["ts"] if row is not None else -1.0  # before any clock reading
    filtered = db.execute(
        "SELECT COUNT(*) FROM events WHERE kind = ? AND ts > ?", (GROUP_FILTERED, since)
    ).fetchone()[0]
    trained = db.execute(
        "SELECT COUNT(*) FROM tasks t JOIN batches b ON b.batch_id = t.batch_id WHERE b.created > ?", (since,)
    ).fetchone()[0]
    return filtered, trained


def _recent(db: Connection, alarm: Alarm, worker_id: str | None, version: int, window: int) -> bool:
    # COALESCE, not `worker_id IS ?`: PostgreSQL takes no parameter after IS (worker ids are never '')
    row = db.execute(
        "SELECT 1 FROM reward_alarms WHERE alarm = ? AND COALESCE(worker_id, '') = ? AND version > ? LIMIT 1",
        (alarm.value, worker_id or "", version - window),
    ).fetchone()
    return row is not None


def run_monitors(db: Connection, config: RewardMonitorConfig, step: StepMetrics, now: float) -> list[str]:
    """Record the step, run every monitor, return one line per new alarm."""
    _record_step(db, step, now)
    history = _history(db)
    found: list[tuple[Alarm, str | None, str]] = []
    detail = reward_without_heldout(history, config)
    if detail is not None:
        found.append((Alarm.REWARD_WITHOUT_HELDOUT, None, detail))
    found += [(alarm, None, text) for alarm, text in jumps(history, config)]
    found += [(Alarm.WORKER_OUTLIER, worker, text) for worker, text in _outliers(db, config)]
    detail = groups_filtered(*_dynamic_sampling(db, step.policy_version, config.window), config)
    if detail is not None:
        found.append((Alarm.GROUPS_FILTERED, None, detail))
    lines = []
    for alarm, worker_id, text in found:
        if _recent(db, alarm, worker_id, step.policy_version, config.window):
            continue
        record_alarm(db, now, alarm, worker_id, text, step.policy_version)
        lines.append(f"{alarm.value}{f' worker {worker_id}' if worker_id else ''}: {text}")
    return lines
