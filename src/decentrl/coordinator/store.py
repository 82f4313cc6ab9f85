"""The coordinator's durable state: one SQLite file in the run directory.

WAL journal with `synchronous=FULL`, so a committed transaction survives a power cut and an
HTTP 2xx (sent only after the commit) really means "on disk". One connection guarded by a lock:
FastAPI runs sync work in a thread pool, and SQLite allows one writer anyway.

States: a task (= one group of `num_slots` rollouts) is pending -> ready (all slots filled) ->
batched (issued to the trainer) -> trained (batch acked), or expired (too stale at batch time).
A lease is open -> done (all its slots filled) or expired (deadline passed; unfilled slots freed).
"""

from __future__ import annotations

import secrets
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS workers (
    worker_id TEXT PRIMARY KEY, name TEXT NOT NULL, engine TEXT NOT NULL,
    token_sha256 TEXT NOT NULL UNIQUE, registered REAL NOT NULL, last_seen REAL NOT NULL);
CREATE TABLE IF NOT EXISTS tasks (
    seq INTEGER PRIMARY KEY, task_id TEXT NOT NULL UNIQUE, group_id TEXT NOT NULL UNIQUE,
    env TEXT NOT NULL, seed INTEGER NOT NULL, prompt_token_ids TEXT NOT NULL,
    num_slots INTEGER NOT NULL, state TEXT NOT NULL, created REAL NOT NULL, batch_id TEXT);
CREATE INDEX IF NOT EXISTS tasks_state ON tasks (state);
CREATE TABLE IF NOT EXISTS slots (
    task_id TEXT NOT NULL, slot INTEGER NOT NULL, lease_id TEXT, rollout_id TEXT,
    PRIMARY KEY (task_id, slot));
CREATE INDEX IF NOT EXISTS slots_lease ON slots (lease_id);
CREATE TABLE IF NOT EXISTS leases (
    lease_id TEXT PRIMARY KEY, worker_id TEXT NOT NULL, created REAL NOT NULL,
    deadline REAL NOT NULL, sampling TEXT NOT NULL, state TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS leases_state ON leases (state, deadline);
CREATE TABLE IF NOT EXISTS lease_slots (
    lease_id TEXT NOT NULL, task_id TEXT NOT NULL, slot INTEGER NOT NULL,
    PRIMARY KEY (lease_id, task_id, slot));
CREATE TABLE IF NOT EXISTS rollouts (
    seq INTEGER PRIMARY KEY, rollout_id TEXT NOT NULL UNIQUE, task_id TEXT NOT NULL,
    slot INTEGER NOT NULL, lease_id TEXT NOT NULL, worker_id TEXT NOT NULL, payload TEXT NOT NULL,
    reward REAL NOT NULL, min_version INTEGER NOT NULL, max_version INTEGER NOT NULL,
    num_model_tokens INTEGER NOT NULL, accepted REAL NOT NULL, staleness INTEGER);
CREATE INDEX IF NOT EXISTS rollouts_task ON rollouts (task_id);
CREATE INDEX IF NOT EXISTS rollouts_accepted ON rollouts (accepted);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY, batch_id TEXT NOT NULL UNIQUE, state TEXT NOT NULL,
    group_ids TEXT NOT NULL, trainer_version INTEGER NOT NULL, acked_version INTEGER,
    num_groups_expired INTEGER NOT NULL, created REAL NOT NULL, acked REAL);
CREATE TABLE IF NOT EXISTS weights (
    version INTEGER PRIMARY KEY, path TEXT NOT NULL, sha256 TEXT NOT NULL,
    num_bytes INTEGER NOT NULL, created REAL NOT NULL, pruned INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY, ts REAL NOT NULL, kind TEXT NOT NULL, worker_id TEXT,
    reason TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS events_kind ON events (kind, reason);
CREATE TABLE IF NOT EXISTS train_metrics (
    version INTEGER PRIMARY KEY, ts REAL NOT NULL, metrics TEXT NOT NULL);
"""

# Event kinds; every rejection and expiry is one row, so nothing is dropped silently.
REJECTED = "rejected"
LEASE_EXPIRED = "lease_expired"
GROUP_EXPIRED = "group_expired"
GROUP_FILTERED = "group_filtered"

GROUP_STATES = ("pending", "ready", "batched", "trained", "expired", "filtered")
UNTRAINED_STATES = ("pending", "ready", "batched")


class Store:
    """One SQLite connection; `transaction()` is the only way in."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        with self._lock:
            self._db.executescript(SCHEMA)
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


def get_meta(db: sqlite3.Connection, key: str) -> str | None:
    row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return None if row is None else row["value"]


def set_meta(db: sqlite3.Connection, key: str, value: str) -> None:
    db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))


def next_counter(db: sqlite3.Connection, key: str) -> int:
    """Return the counter's value and advance it by one (durable with the enclosing transaction)."""
    value = int(get_meta(db, key) or 0)
    set_meta(db, key, str(value + 1))
    return value


def add_event(db: sqlite3.Connection, ts: float, kind: str, worker_id: str | None, reason: str) -> None:
    db.execute(
        "INSERT INTO events (ts, kind, worker_id, reason) VALUES (?, ?, ?, ?)", (ts, kind, worker_id, reason)
    )


def latest_version(db: sqlite3.Connection) -> int | None:
    return db.execute("SELECT MAX(version) AS v FROM weights").fetchone()["v"]


def count_untrained_groups(db: sqlite3.Connection) -> int:
    marks = ",".join("?" * len(UNTRAINED_STATES))
    query = f"SELECT COUNT(*) AS n FROM tasks WHERE state IN ({marks})"
    return db.execute(query, UNTRAINED_STATES).fetchone()["n"]


def table_counts(db: sqlite3.Connection) -> dict[str, int]:
    """Row count of every table (tests use it to prove a rejection stored nothing)."""
    names = [row["name"] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    return {name: db.execute(f"SELECT COUNT(*) AS n FROM {name}").fetchone()["n"] for name in names}
