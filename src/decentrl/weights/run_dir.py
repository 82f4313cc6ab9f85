"""A run directory's published weights, read from disk the way a worker reads them over HTTP.

`decentrl eval RUN_DIR` and `decentrl export RUN` reconstruct a version with the workers' own
fetch-verify-apply path (`weights/sync.py`): every manifest's signature is checked against the
trainer key the run registered, every chunk's hash, the chain of state hashes and the final state
hash. `RunWeights` stands in for the coordinator client, serving the manifests and chunks the
coordinator wrote (`weights/manifests/`, `weights/chunks/`) and the facts it committed to its
store, opened read-only so a live run is not disturbed: `coordinator.db` in the run directory, or
the PostgreSQL database its `config.json` names (`coordinator.store`).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from decentrl import pgsql
from decentrl.dbapi import Connection
from decentrl.protocol import WeightsEntry
from decentrl.weights.manifest import Manifest, ManifestKey
from decentrl.weights.planner import index_entry

DATABASE = "coordinator.db"
STORE_FILE = "store.json"
"""Written by a coordinator whose store is PostgreSQL: {"store": its URL} (owner-only)."""
TRAINER_KEY = "trainer_public_key"
"""The store's meta key holding the trainer's Ed25519 public key (hex)."""


class NotARun(ValueError):
    """The directory holds no published weights of a decentrl run."""


def store_location(run_dir: Path) -> str | None:
    """Where the run's store is: "sqlite" (`coordinator.db` in `run_dir`), the PostgreSQL URL its
    coordinator recorded (`store.json`) or its `config.json` names, or None (not a run directory)."""
    if (run_dir / DATABASE).is_file():
        return "sqlite"
    for name, keys in ((STORE_FILE, ("store",)), ("config.json", ("coordinator", "store"))):
        try:
            found = json.loads((run_dir / name).read_text())
            for key in keys:
                found = found[key]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(found, str) and found.startswith(("postgresql://", "postgres://")):
            return found
    return None


@contextmanager
def read_only(run_dir: Path) -> Iterator[Connection]:
    """A read-only connection to the run's store (rows by column name and position): SQLite in WAL
    mode reads while the coordinator writes; PostgreSQL refuses any write on the session."""
    location = store_location(run_dir)
    if location is None:
        raise NotARun(f"{run_dir} has no {DATABASE} and its config.json names no PostgreSQL store")
    if location == "sqlite":
        db = sqlite3.connect(f"file:{run_dir / DATABASE}?mode=ro", uri=True, check_same_thread=False)
        db.row_factory = sqlite3.Row
        try:
            yield db
        finally:
            db.close()
        return
    connection = pgsql.connect(location, read_only=True)
    try:
        yield pgsql.Connection(connection, keys=())
    finally:
        connection.close()


def rows(db: Connection, query: str, *args: Any) -> list[Any]:
    """`query`'s rows; none when it reads a table (or column) the run has not created (yet)."""
    try:
        return db.execute(query, args).fetchall()
    except Exception as error:
        if pgsql.missing_table(error):
            return []
        raise


def has_table(db: Connection, table: str) -> bool:
    """Whether the run's store has `table` (a run from an older decentrl may lack it)."""
    try:
        db.execute(f"SELECT 1 FROM {table} LIMIT 0").fetchall()
    except Exception as error:
        if pgsql.missing_table(error):
            return False
        raise
    return True


class RunWeights:
    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        manifests = self.run_dir / "weights" / "manifests"
        if store_location(self.run_dir) is None or not manifests.is_dir():
            raise NotARun(
                f"{run_dir} is not a run directory (no {DATABASE} or PostgreSQL store, and "
                "weights/manifests); pass the directory given to `decentrl demo --run-dir` or "
                "`decentrl coordinator --run-dir`"
            )
        with read_only(self.run_dir) as db:
            key = db.execute("SELECT value FROM meta WHERE key = ?", (TRAINER_KEY,)).fetchone()
            self.versions: dict[int, str] = {
                row["version"]: row["sha256"]
                for row in db.execute("SELECT version, sha256 FROM weights ORDER BY version")
            }
            """Every version the run published and its state hash (pruned ones included)."""
        if key is None or not self.versions:
            raise NotARun(f"{run_dir}: the trainer never published a version")
        self.trainer_public_key: str = key["value"]
        self.manifests: dict[ManifestKey, Manifest] = {}
        self._raw: dict[ManifestKey, bytes] = {}
        for path in sorted(manifests.glob("v*.json")):
            raw = path.read_bytes()
            manifest = Manifest.model_validate_json(raw)
            if manifest.version in self.versions:  # written but never committed: not published
                self.manifests[manifest.key], self._raw[manifest.key] = manifest, raw

    @property
    def latest_version(self) -> int:
        return max(self.versions)

    # The subset of CoordinatorClient that WeightSync and ChunkFetcher use.

    def weights_index(self) -> list[WeightsEntry]:
        return [index_entry(manifest) for manifest in self.manifests.values()]

    def manifest_bytes(
        self, version: int, kind: str, anchor: int | None = None, stage: int | None = None
    ) -> bytes:
        assert stage is None, "a run of one trainer"
        return self._raw[(version, kind, anchor)]

    def chunk(self, sha256: str) -> bytes:
        return (self.run_dir / "weights" / "chunks" / sha256[:2] / sha256).read_bytes()

    def request_snapshot(self) -> dict:
        return {"pending": False}


def reconstruct(run: RunWeights, version: int, cache: Path) -> tuple[dict, list[Manifest]]:
    """The verified state of `version` (inference dtype, published layout) and the signed manifests
    of the route that rebuilt it, snapshot first. Raises `VerificationFailed` on any mismatch."""
    from decentrl.weights.chunks import ChunkStore
    from decentrl.weights.signing import parse_public_key
    from decentrl.weights.sync import WeightSync
    from decentrl.weights.transfer import ChunkFetcher

    if version not in run.versions:
        raise NotARun(f"{run.run_dir}: no version {version}; it published v0..v{run.latest_version}")
    fetcher = ChunkFetcher(run, ChunkStore(cache, durable=False))  # type: ignore[arg-type]
    try:
        sync = WeightSync(run, parse_public_key(run.trainer_public_key), fetcher)  # type: ignore[arg-type]
        sync.sync_to(version)
        route = sync.routes[-1][2]
        manifests = [run.manifests[(v, kind, route.anchor(v, kind))] for v, kind in route.steps]
        return sync.state, manifests
    finally:
        fetcher.close()
