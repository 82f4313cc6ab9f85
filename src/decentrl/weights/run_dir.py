"""A run directory's published weights, read from disk the way a worker reads them over HTTP.

`decentrl eval RUN_DIR` and `decentrl export RUN` reconstruct a version with the workers' own
fetch-verify-apply path (`weights/sync.py`): every manifest's signature is checked against the
trainer key the run registered, every chunk's hash, the chain of state hashes and the final state
hash. `RunWeights` stands in for the coordinator client, serving the manifests and chunks the
coordinator wrote (`weights/manifests/`, `weights/chunks/`) and the facts it committed to its
store (`coordinator.db`), opened read-only so a live run is not disturbed.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

from decentrl.protocol import WeightsEntry
from decentrl.weights.manifest import Manifest, ManifestKey
from decentrl.weights.planner import index_entry

DATABASE = "coordinator.db"
TRAINER_KEY = "trainer_public_key"
"""The store's meta key holding the trainer's Ed25519 public key (hex)."""


class NotARun(ValueError):
    """The directory holds no published weights of a decentrl run."""


def read_only(path: Path) -> sqlite3.Connection:
    """A read-only connection (WAL lets it read while the coordinator writes)."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
    db.row_factory = sqlite3.Row
    return db


class RunWeights:
    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        database = self.run_dir / DATABASE
        manifests = self.run_dir / "weights" / "manifests"
        if not database.is_file() or not manifests.is_dir():
            raise NotARun(
                f"{run_dir} is not a run directory (no {DATABASE} and weights/manifests); pass the "
                "directory given to `decentrl demo --run-dir` or `decentrl coordinator --run-dir`"
            )
        with closing(read_only(database)) as db:
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

    def manifest_bytes(self, version: int, kind: str, anchor: int | None = None) -> bytes:
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
