"""Which store a run uses: SQLite in the run directory, or a PostgreSQL database (`coordinator.store`)."""

from __future__ import annotations

from pathlib import Path

from decentrl.config import ConfigError
from decentrl.coordinator.db.store import Database, Store
from decentrl.private_files import write_private_json
from decentrl.weights.run_dir import STORE_FILE


def open_store(run_dir: Path, location: str) -> Database:
    """The run's store: SQLite in the run directory, or the PostgreSQL database at `location`."""
    if location == "sqlite":
        return Store(run_dir / "coordinator.db")
    if (run_dir / "coordinator.db").is_file():
        raise ConfigError(
            f"{run_dir} holds a SQLite coordinator.db, but coordinator.store names a PostgreSQL "
            'database; keep coordinator.store = "sqlite" for this run, or start the run in a new run directory'
        )
    from decentrl.coordinator.db.postgres import PostgresStore  # psycopg only where it is used

    # Its transactions yield a shim with `store.Connection`'s `execute`/`executemany` (rows by
    # column name), the same protocol SQLite's connection meets, so the coordinator has one type.
    store = PostgresStore(location)
    # The run directory says where its store is, for the readers of a run (export, eval, the
    # dashboard) however the coordinator was started; owner-only, as the URL may hold a password.
    write_private_json(run_dir / STORE_FILE, {"store": location})
    return store
