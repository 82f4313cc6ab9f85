"""The coordinator's durable state: one SQLite file in the run directory.

WAL journal with `synchronous=FULL`, so a committed transaction survives a power cut and an
HTTP 2xx (sent only after the commit) really means "on disk". One connection guarded by a lock:
FastAPI runs sync work in a thread pool, and SQLite allows one writer anyway.

States: a task (= one group of `num_slots` rollouts) is pending -> ready (all slots filled) ->
batched (issued to the trainer) -> trained (batch acked), or expired (too stale at batch time), or
env_failed (a served task whose episodes failed `task.max_env_failures` times: given up, never trained).
A lease is open -> done (all its slots filled) or expired (deadline passed; unfilled slots freed).

The rest of the coordinator sees a store only through `Database`: `transaction()` yields a
connection with `execute`/`executemany` (`?` parameters, rows readable by column name) and
commits when the block exits. A second backend (PostgreSQL, say) implements that, translating the
placeholders, and runs `schema.MIGRATIONS` its own way; `Store` is the SQLite one.
"""

from __future__ import annotations

import secrets
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Protocol

from decentrl.coordinator.db.schema import migrate
from decentrl.dbapi import Connection

# Event kinds; every rejection and expiry is one row, so nothing is dropped silently.
REJECTED = "rejected"
LEASE_EXPIRED = "lease_expired"
GROUP_EXPIRED = "group_expired"
GROUP_FILTERED = "group_filtered"
STAGE_HOP_FAILED = "stage_hop_failed"  # a route's stage holder failed mid-lease; the lease was re-leased
PROMPT_SKIPPED = "prompt_skipped"  # a train problem whose prompt leaves no room in the context
ENV_FAILED = "env_failed"  # a served episode whose environment failed (reason: crash, timeout, ...)

GROUP_STATES = ("pending", "ready", "batched", "trained", "expired", "filtered", "env_failed")
UNTRAINED_STATES = ("pending", "ready", "batched")


class Database(Protocol):
    """What the coordinator needs of its durable store."""

    def transaction(self) -> AbstractContextManager[Connection]:
        """Serialised read-write transaction, committed durably when the block exits cleanly."""
        ...

    shared: bool
    """Whether other coordinator processes (replicas) may use the same store at the same time."""

    def close(self) -> None: ...


class Store:
    """The SQLite `Database`: one connection; `transaction()` is the only way in."""

    shared = False  # one coordinator process per run directory

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        with self._lock:
            migrate(self._db)
        with self.transaction() as db:
            if get_meta(db, "run_id") is None:
                set_meta(db, "run_id", secrets.token_hex(8))

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """Serialised read-write transaction; committed (and fsynced) when the block exits cleanly."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()


def get_meta(db: Connection, key: str) -> str | None:
    row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return None if row is None else row["value"]


def set_meta(db: Connection, key: str, value: str) -> None:
    db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))


def next_counter(db: Connection, key: str) -> int:
    """Return the counter's value and advance it by one (durable with the enclosing transaction)."""
    value = int(get_meta(db, key) or 0)
    set_meta(db, key, str(value + 1))
    return value


def add_event(db: Connection, ts: float, kind: str, worker_id: str | None, reason: str) -> None:
    db.execute(
        "INSERT INTO events (ts, kind, worker_id, reason) VALUES (?, ?, ?, ?)", (ts, kind, worker_id, reason)
    )


def remember_nonce(db: Connection, identity: str, nonce: str, expires: float) -> bool:
    """Record a signed request's nonce until `expires`; False when it was already recorded."""
    added = db.execute(
        "INSERT OR IGNORE INTO nonces (identity, nonce, expires) VALUES (?, ?, ?)", (identity, nonce, expires)
    )
    return added.rowcount == 1


def forget_nonces(db: Connection, now: float) -> None:
    db.execute("DELETE FROM nonces WHERE expires < ?", (now,))


def save_buckets(
    db: Connection, limiter: str, buckets: dict[str, tuple[float, float]], rate: float, burst: float
) -> None:
    """Merge `limiter`'s rate-limit buckets (key -> (tokens, last)) into the stored ones. Replicas of
    a run save into the same rows: where a key is stored already, the emptier bucket (compared at the
    later of the two times, refilled at `rate` up to `burst`) is kept, so no replica's saving hands
    a worker back what it spent at another; rows refilled to the burst by now are dropped."""
    stored = load_buckets(db, limiter)
    merged = dict(stored)
    for key, (tokens, last) in buckets.items():
        if key in stored:
            at = max(last, stored[key][1])
            mine = min(burst, tokens + (at - last) * rate)
            theirs = min(burst, stored[key][0] + (at - stored[key][1]) * rate)
            merged[key] = (tokens, last) if mine <= theirs else stored[key]
        else:
            merged[key] = (tokens, last)
    now = max((last for _, last in merged.values()), default=0.0)
    db.execute("DELETE FROM rate_buckets WHERE limiter = ?", (limiter,))
    db.executemany(
        "INSERT INTO rate_buckets (limiter, key, tokens, last) VALUES (?, ?, ?, ?)",
        [(limiter, k, t, last) for k, (t, last) in merged.items() if t + (now - last) * rate < burst],
    )


def load_buckets(db: Connection, limiter: str) -> dict[str, tuple[float, float]]:
    rows = db.execute("SELECT key, tokens, last FROM rate_buckets WHERE limiter = ?", (limiter,))
    return {row["key"]: (row["tokens"], row["last"]) for row in rows}


def latest_version(db: Connection) -> int | None:
    return db.execute("SELECT MAX(version) AS v FROM weights").fetchone()["v"]


def is_held(db: Connection, task_id: str) -> bool:
    """Whether a rollout of the task awaits a verifier's verdict (`trust/verification.py`)."""
    return db.execute("SELECT 1 FROM holds WHERE task_id = ? LIMIT 1", (task_id,)).fetchone() is not None


def is_scoring(db: Connection, task_id: str) -> bool:
    """A rollout of the task still waits for its reward (`pipeline/scoring.py`)."""
    query = "SELECT 1 FROM reward_pending WHERE task_id = ? LIMIT 1"
    return db.execute(query, (task_id,)).fetchone() is not None


def is_filled(db: Connection, task_id: str) -> bool:
    unfilled = db.execute("SELECT COUNT(*) FROM slots WHERE task_id = ? AND rollout_id IS NULL", (task_id,))
    return unfilled.fetchone()[0] == 0


def complete_tasks(db: Connection, task_ids: set[str]) -> int:
    """Mark full groups ready unless a rollout awaits verification or its reward; return how many
    became ready."""
    completed = 0
    for task_id in task_ids:
        if is_filled(db, task_id) and not is_held(db, task_id) and not is_scoring(db, task_id):
            ready = db.execute(
                "UPDATE tasks SET state = 'ready' WHERE task_id = ? AND state = 'pending'", (task_id,)
            )
            completed += ready.rowcount
    return completed


def discard_rollout(db: Connection, rollout_id: str) -> None:
    """Remove an untrained rollout with everything still pending on it (verification, hold,
    reward) and free its slot, so that the group is leased and filled again."""
    row = db.execute("SELECT task_id, slot FROM rollouts WHERE rollout_id = ?", (rollout_id,)).fetchone()
    assert row is not None, f"no rollout {rollout_id} to discard"
    for table in ("rollouts", "verify_jobs", "holds", "reward_pending"):
        db.execute(f"DELETE FROM {table} WHERE rollout_id = ?", (rollout_id,))
    db.execute(
        "UPDATE slots SET rollout_id = NULL, lease_id = NULL WHERE task_id = ? AND slot = ?",
        (row["task_id"], row["slot"]),
    )
    db.execute("UPDATE tasks SET state = 'pending' WHERE task_id = ?", (row["task_id"],))


def count_untrained_groups(db: Connection) -> int:
    marks = ",".join("?" * len(UNTRAINED_STATES))
    query = f"SELECT COUNT(*) AS n FROM tasks WHERE state IN ({marks})"
    return db.execute(query, UNTRAINED_STATES).fetchone()["n"]


def table_counts(db: Connection) -> dict[str, int]:
    """Row count of every table (tests use it to prove a rejection stored nothing)."""
    names = [row["name"] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    return {name: db.execute(f"SELECT COUNT(*) AS n FROM {name}").fetchone()["n"] for name in names}
