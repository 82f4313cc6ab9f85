"""The PostgreSQL store against a real server: migrations, reopening, a database from the future."""

from __future__ import annotations

import psycopg
import pytest

from decentrl.coordinator.db.postgres import PostgresStore
from decentrl.coordinator.db.schema import MIGRATIONS, SchemaTooNew
from decentrl.coordinator.db.store import get_meta, next_counter, table_counts


def test_a_new_database_is_migrated_and_reopening_keeps_the_run(postgres_url: str) -> None:
    store = PostgresStore(postgres_url)
    with store.transaction() as db:
        run_id = get_meta(db, "run_id")
        assert next_counter(db, "next_task") == 0
        tables = table_counts(db)
    store.close()
    assert {"tasks", "slots", "leases", "rollouts", "batches", "events", "holds"} <= set(tables)
    reopened = PostgresStore(postgres_url)
    with reopened.transaction() as db:
        assert get_meta(db, "run_id") == run_id
        assert next_counter(db, "next_task") == 1
        assert db.execute("SELECT version FROM schema_version").fetchone()[0] == len(MIGRATIONS)
    reopened.close()


def test_a_rolled_back_transaction_leaves_nothing(postgres_url: str) -> None:
    store = PostgresStore(postgres_url)
    with pytest.raises(ZeroDivisionError), store.transaction() as db:
        next_counter(db, "next_task")
        raise ZeroDivisionError
    with store.transaction() as db:
        assert next_counter(db, "next_task") == 0
    store.close()


def test_a_database_from_a_newer_decentrl_is_refused(postgres_url: str) -> None:
    PostgresStore(postgres_url).close()
    with psycopg.connect(postgres_url, autocommit=True) as connection:
        connection.execute("UPDATE schema_version SET version = 99")
    with pytest.raises(SchemaTooNew, match="schema version 99"):
        PostgresStore(postgres_url)
