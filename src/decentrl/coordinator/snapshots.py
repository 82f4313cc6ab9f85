"""Published weight versions on the coordinator: signed manifests and content-addressed chunks.

The trainer uploads a version's chunks (`PUT /v1/weights/chunks/{sha256}`: stored only if the
bytes hash to the name, fsynced before the 2xx), then its signed manifest (`PUT
/v1/weights/manifests/{version}/{kind}`). The manifest is accepted only if it verifies under the
trainer key registered for the run, is structurally sound, every chunk it names is stored with the
right size, and it extends the history (a delta's parent state is the stored state of version-1).
The manifest file is fsynced and renamed into place before the version's row commits, so a
listed version is always complete. Old versions are pruned so that every retained one stays
reachable (see `retained_from`). No torch: chunks are opaque, verified bytes here.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
import threading
from pathlib import Path

from pydantic import ValidationError

from decentrl.coordinator.context import ApiError, Context
from decentrl.coordinator.store import get_meta, latest_version, set_meta
from decentrl.protocol import TrainerKey, WeightsEntry, WeightsInfo
from decentrl.weights.chunks import ChunkStore, _fsync_dir
from decentrl.weights.manifest import Manifest, check_layout
from decentrl.weights.signing import BadSignature, parse_public_key, verify

KEY_META = "trainer_public_key"


def manifest_name(version: int, kind: str) -> str:
    return f"v{version:08d}.{kind}.json"


def _info(row: sqlite3.Row) -> WeightsInfo:
    return WeightsInfo(
        version=row["version"], sha256=row["sha256"], num_bytes=row["num_bytes"], created_unix=row["created"]
    )


class WeightStore:
    """Manifests in `weights/manifests/`, chunks in `weights/chunks/`, one row per version in `weights`."""

    def __init__(self, context: Context):
        self.context = context
        self.manifest_dir = context.weights_dir / "manifests"
        self.manifest_dir.mkdir(parents=True, exist_ok=True)
        self.chunks = ChunkStore(context.weights_dir / "chunks")
        self.keep_versions = context.run.weights.keep_versions
        self._lock = threading.Lock()  # one publish at a time (there is one trainer)
        self.manifests: dict[tuple[int, str], Manifest] = {}
        self._load()

    def _load(self) -> None:
        with self.context.store.transaction() as db:
            latest = latest_version(db)
        for path in self.manifest_dir.iterdir():
            if path.name.startswith("."):  # an interrupted write
                path.unlink()
                continue
            manifest = Manifest.model_validate_json(path.read_bytes())
            if latest is None or manifest.version > latest:  # written, but the row never committed
                path.unlink()
                continue
            self.manifests[(manifest.version, manifest.kind)] = manifest

    # ------------------------------------------------------------------ trainer key

    def trainer_key(self) -> str | None:
        with self.context.store.transaction() as db:
            return get_meta(db, KEY_META)

    def register_key(self, body: TrainerKey) -> dict:
        with self.context.store.transaction() as db:
            current = get_meta(db, KEY_META)
            if current is not None and current != body.public_key:
                raise ApiError(
                    409,
                    "this run's trainer key is already registered and differs; restore the trainer's "
                    "run_dir/trainer/signing_key.pem or start a new run",
                    "conflict",
                )
            set_meta(db, KEY_META, body.public_key)
        return {"public_key": body.public_key}

    # ------------------------------------------------------------------ uploads

    def put_chunk(self, digest: str, data: bytes) -> dict:
        if not self.chunks.put(digest, data):
            raise ApiError(422, f"chunk body does not hash to {digest}", "hash")
        return {"sha256": digest, "size": len(data)}

    def put_manifest(self, version: int, kind: str, body: bytes) -> WeightsInfo:
        try:
            manifest = Manifest.model_validate_json(body)
        except ValidationError as error:
            raise ApiError(422, f"invalid manifest: {error.errors()[0]['msg']}", "schema") from None
        if (manifest.version, manifest.kind) != (version, kind):
            raise ApiError(
                422, f"manifest is v{manifest.version} {manifest.kind}, URL says v{version} {kind}"
            )
        problem = check_layout(manifest)
        if problem:
            raise ApiError(422, f"manifest v{version}: {problem}", "schema")
        key = self.trainer_key()
        if key is None:
            raise ApiError(409, "no trainer key registered; PUT /v1/trainer/key first", "conflict")
        try:
            verify(manifest, parse_public_key(key))
        except BadSignature as error:
            raise ApiError(422, str(error), "signature") from None
        for chunk in manifest.chunks:
            path = self.chunks.path(chunk.sha256)
            if not path.is_file() or path.stat().st_size != chunk.size:
                raise ApiError(409, f"chunk {chunk.sha256} is not uploaded (or has another size)", "conflict")
        with self._lock:
            return self._publish(manifest)

    def _publish(self, manifest: Manifest) -> WeightsInfo:
        version, kind = manifest.version, manifest.kind
        with self.context.store.transaction() as db:
            row = db.execute("SELECT * FROM weights WHERE version = ?", (version,)).fetchone()
            latest = latest_version(db)
        existing = self.manifests.get((version, kind))
        if existing is not None:
            if existing != manifest:
                raise ApiError(409, f"v{version} {kind} is already published differently", "conflict")
            return _info(row)
        if row is not None and row["sha256"] != manifest.state_sha256:
            raise ApiError(409, f"v{version} is already published with another state hash", "conflict")
        expected = 0 if latest is None else latest + 1
        if row is None and version != expected:
            raise ApiError(409, f"cannot publish v{version}: the next version must be {expected}", "conflict")
        if row is None and kind == "delta" and not self._extends(manifest):
            raise ApiError(409, f"delta v{version} does not apply to the stored v{version - 1}", "conflict")
        if row is None and version == 0 and kind != "snapshot":
            raise ApiError(409, "version 0 must be a snapshot", "conflict")
        self._write(manifest)
        with self.context.store.transaction() as db:
            if row is None:
                db.execute(
                    "INSERT INTO weights (version, path, sha256, num_bytes, created) VALUES (?, ?, ?, ?, ?)",
                    (
                        version,
                        manifest_name(version, kind),
                        manifest.state_sha256,
                        manifest.payload_bytes,
                        self.context.clock(),
                    ),
                )
            self.manifests[(version, kind)] = manifest
            self._prune(db)
            row = db.execute("SELECT * FROM weights WHERE version = ?", (version,)).fetchone()
        return _info(row)

    def _extends(self, manifest: Manifest) -> bool:
        with self.context.store.transaction() as db:
            parent = db.execute("SELECT sha256 FROM weights WHERE version = ?", (manifest.parent,)).fetchone()
        return parent is not None and parent["sha256"] == manifest.parent_state_sha256

    def _write(self, manifest: Manifest) -> None:
        final = self.manifest_dir / manifest_name(manifest.version, manifest.kind)
        descriptor, name = tempfile.mkstemp(prefix=".", dir=self.manifest_dir)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(manifest.model_dump_json().encode())
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(name, final)
        _fsync_dir(self.manifest_dir)

    # ------------------------------------------------------------------ retention

    def retained_from(self) -> int:
        """Oldest version kept: the newest `keep_versions`, extended back to the newest snapshot at or
        before their start so that a worker holding nothing can still reach each of them."""
        versions = {version for version, _ in self.manifests}
        if not versions:
            return 0
        start = max(versions) - self.keep_versions + 1
        snapshots = [v for v, kind in self.manifests if kind == "snapshot" and v <= start]
        return min(start, max(snapshots)) if snapshots else min(versions)

    def _prune(self, db: sqlite3.Connection) -> None:
        oldest = self.retained_from()
        for version, kind in [key for key in self.manifests if key[0] < oldest]:
            del self.manifests[(version, kind)]
            (self.manifest_dir / manifest_name(version, kind)).unlink(missing_ok=True)
            db.execute("UPDATE weights SET pruned = 1 WHERE version = ?", (version,))
        wanted = {chunk.sha256 for manifest in self.manifests.values() for chunk in manifest.chunks}
        for digest in self.chunks.digests() - wanted:
            self.chunks.remove(digest)

    # ------------------------------------------------------------------ reads

    def latest(self) -> WeightsInfo | None:
        with self.context.store.transaction() as db:
            row = db.execute("SELECT * FROM weights ORDER BY version DESC LIMIT 1").fetchone()
        return None if row is None else _info(row)

    def index(self) -> list[WeightsEntry]:
        return [
            WeightsEntry(
                version=m.version, kind=m.kind, payload_bytes=m.payload_bytes, state_sha256=m.state_sha256
            )
            for _, m in sorted(self.manifests.items())
        ]

    def manifest(self, version: int, kind: str) -> Manifest:
        manifest = self.manifests.get((version, kind))
        if manifest is not None:
            return manifest
        latest = self.latest()
        if latest is None or version > latest.version:
            raise ApiError(404, f"weights version {version} was never published", "unknown_version")
        if version < self.retained_from():
            raise ApiError(410, f"weights version {version} was pruned; fetch a newer version", "pruned")
        raise ApiError(
            404, f"version {version} has no {kind} manifest (see GET /v1/weights/index)", "unknown"
        )

    def chunk_path(self, digest: str) -> Path:
        if len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
            raise ApiError(422, "a chunk name is 64 lowercase hex digits", "schema")
        path = self.chunks.path(digest)
        if not path.is_file():
            raise ApiError(404, f"no chunk {digest}", "unknown_chunk")
        return path
