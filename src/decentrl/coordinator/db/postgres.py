"""The coordinator's store on PostgreSQL (`coordinator.store = "postgresql://..."`), for replicas.

The same schema and the same SQL as the SQLite store, through `decentrl/pgsql.py`'s shim: it turns
the few SQLite spellings the coordinator uses into PostgreSQL once per statement, and its rows
answer by name and by position as `sqlite3.Row` does, so the pipeline code is backend-blind.

Several coordinator processes may share one database. Every transaction first takes one
transaction-scoped advisory lock of the run: writers are serialised exactly as SQLite serialises
them, so leasing, ingestion, batching and verification keep the invariants they have on SQLite (no
slot leased twice, a rollout stored once, a batch issued once) whatever replica a request reaches,
and a replica killed mid-transaction leaves nothing behind (its connection dies, the transaction
rolls back, the lock is released). The CPU-heavy work (TLS, parsing, signatures, scoring, JSON)
runs outside the lock, in parallel across replicas; `decentrl bench coordinator --replicas` measures
what that buys. A commit waits for the WAL flush (`synchronous_commit` on), so a 2xx still means
the rollout is on disk.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from decentrl.coordinator.db.schema import MIGRATIONS, SchemaTooNew
from decentrl.coordinator.db.store import get_meta, set_meta
from decentrl.pgsql import Connection, connect, primary_keys, require_psycopg, translate_schema

# Any 64-bit number names the lock; replicas of one run share the database, hence the lock.
RUN_LOCK = 0x6465_6365_6E74_726C  # "decentrl"


class PostgresDatabase:
    """A pool of connections to one database; `transaction()` serialises writers over all replicas."""

    shared = True  # replicas of the run share it

    def __init__(self, url: str, schema: str) -> None:
        require_psycopg()
        self.url = url
        self.keys = tuple(sorted(primary_keys(schema).items()))
        self._idle: list[Any] = []
        self._lock = threading.Lock()

    def _connect(self) -> Any:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return connect(self.url)  # autocommit: `transaction()` opens and commits

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        connection = self._connect()
        try:
            with connection.transaction():
                connection.execute("SELECT pg_advisory_xact_lock(%s)", (RUN_LOCK,))
                yield Connection(connection, self.keys)
        except BaseException:
            if connection.closed or connection.broken:
                raise
            with self._lock:
                self._idle.append(connection)
            raise
        with self._lock:
            self._idle.append(connection)

    def close(self) -> None:
        with self._lock:
            for connection in self._idle:
                connection.close()
            self._idle.clear()


def statements(script: str) -> list[str]:
    return [part.strip() for part in script.split(";") if part.strip()]


def migrate_postgres(database: PostgresDatabase, migrations: Sequence[str], too_new: type[Exception]) -> int:
    """Apply the missing migrations in one transaction (PostgreSQL's DDL is transactional); the
    number applied lives in `schema_version`, PostgreSQL's counterpart of `PRAGMA user_version`."""
    with database.transaction() as db:
        db.execute("CREATE TABLE IF NOT EXISTS schema_version (version BIGINT NOT NULL)")
        row = db.execute("SELECT version FROM schema_version").fetchone()
        if row is None:
            db.execute("INSERT INTO schema_version (version) VALUES (0)")
        current = 0 if row is None else int(row[0])
        if current > len(migrations):
            raise too_new(
                f"the coordinator database has schema version {current}, newer than this decentrl's "
                f"{len(migrations)}; run the coordinator with the decentrl that created the run"
            )
        for version in range(current + 1, len(migrations) + 1):
            for statement in statements(translate_schema(migrations[version - 1])):
                db.execute(statement)
            db.execute("UPDATE schema_version SET version = ?", (version,))
    return len(migrations)


class PostgresStore(PostgresDatabase):
    """`Store`'s interface on PostgreSQL: the schema migrated on open, the run's id in `meta`."""

    def __init__(self, url: str) -> None:
        super().__init__(url, "\n".join(MIGRATIONS))
        self.path = None  # no file: the run's state is in the database at `url`
        migrate_postgres(self, MIGRATIONS, SchemaTooNew)
        with self.transaction() as db:
            if get_meta(db, "run_id") is None:
                set_meta(db, "run_id", secrets.token_hex(8))
