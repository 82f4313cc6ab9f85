"""The coordinator's one schema: numbered migrations tracked by `PRAGMA user_version`."""

from __future__ import annotations

import sqlite3

import pytest

from decentrl.coordinator.db.schema import MIGRATIONS, SchemaTooNew, migrate, schema_version
from decentrl.coordinator.db.store import Store, table_counts

TABLES = {
    "meta", "workers", "tasks", "slots", "leases", "lease_slots", "rollouts", "batches", "weights",
    "events", "train_metrics", "worker_keys", "reputation", "repeat_evidence", "verify_jobs", "holds",
    "reward_pending", "reward_scores", "reward_steps", "reward_alarms",
    "nonces", "rate_buckets", "repeat_references",
    "trainer_logprobs", "weight_traffic", "peers", "peer_reports", "stage_holders", "lease_routes", "stage_traces",
    "env_servers", "env_episodes", "route_latency",
}  # fmt: skip


def test_a_new_store_has_every_table_at_the_latest_version(tmp_path) -> None:
    store = Store(tmp_path / "c.db")
    with store.transaction() as db:
        assert set(table_counts(db)) == TABLES
        assert schema_version(db) == len(MIGRATIONS)
    store.close()


def test_reopening_keeps_the_rows_and_applies_nothing_twice(tmp_path) -> None:
    store = Store(tmp_path / "c.db")
    with store.transaction() as db:
        run_id = db.execute("SELECT value FROM meta WHERE key = 'run_id'").fetchone()[0]
        db.execute("INSERT INTO holds VALUES ('r1', 't1', 's1')")
    store.close()
    again = Store(tmp_path / "c.db")
    with again.transaction() as db:
        assert db.execute("SELECT value FROM meta WHERE key = 'run_id'").fetchone()[0] == run_id
        assert table_counts(db)["holds"] == 1
    again.close()


def test_an_unversioned_database_is_adopted(tmp_path) -> None:
    """A database whose tables exist at user_version 0 reaches the latest version with its rows."""
    db = sqlite3.connect(tmp_path / "old.db", isolation_level=None)
    db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    db.execute("INSERT INTO meta VALUES ('run_id', 'abc')")
    assert migrate(db) == len(MIGRATIONS)
    assert schema_version(db) == len(MIGRATIONS)
    assert db.execute("SELECT value FROM meta").fetchone()[0] == "abc"
    db.close()


def test_a_newer_database_is_refused_with_the_fix(tmp_path) -> None:
    db = sqlite3.connect(tmp_path / "new.db", isolation_level=None)
    db.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    with pytest.raises(SchemaTooNew, match="newer than this decentrl"):
        migrate(db)
    db.close()


def test_a_database_at_version_1_gains_the_trust_tables(tmp_path) -> None:
    """The later migrations (rewards; nonces, rate buckets, repeat references) apply to a run made
    at version 1."""
    db = sqlite3.connect(tmp_path / "v1.db", isolation_level=None)
    db.executescript(f"BEGIN; {MIGRATIONS[0]} PRAGMA user_version = 1; COMMIT;")
    db.execute("INSERT INTO meta VALUES ('run_id', 'abc')")
    assert migrate(db) == len(MIGRATIONS)
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"nonces", "rate_buckets", "repeat_references"} <= tables
    db.close()
