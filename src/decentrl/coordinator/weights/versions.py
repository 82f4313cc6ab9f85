"""Published weight versions on the coordinator: signed manifests and content-addressed chunks.

The trainer uploads a version's chunks (`PUT /v1/weights/chunks/{sha256}`: stored only if the
bytes hash to the name, fsynced before the 2xx), then its signed manifest (`PUT
/v1/weights/manifests/{version}/{kind}`). The manifest is accepted only if it verifies under the
trainer key registered for the run, is structurally sound, every chunk it names is stored with the
right size, and it extends the history (a delta's parent state is the stored state of version-1; a
patch comes after its version's delta or snapshot, and its anchor state is the stored one).
The manifest file is fsynced and renamed into place before the version's row commits, so a
listed version is always complete. Old versions are pruned so that every retained one stays
reachable (see `retained_from`). No torch: chunks are opaque, verified bytes here.

A staged run's stage map is computed once at start (`Context.stage_map`) and is fixed for the run: every
manifest must name exactly it (and so carry its sections), and a restart whose config makes another
map than the published versions name refuses to start.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import tempfile
import threading
from pathlib import Path

from pydantic import ValidationError

from decentrl.config import ConfigError
from decentrl.coordinator.context import Context
from decentrl.coordinator.db.store import get_meta, latest_version, set_meta
from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.dbapi import Connection
from decentrl.protocol import TrainerKey, WeightsEntry, WeightsInfo
from decentrl.stage_map import StageMap
from decentrl.weights.chunks import ChunkStore, _fsync_dir
from decentrl.weights.manifest import Manifest, ManifestKey, check_layout
from decentrl.weights.planner import index_entry
from decentrl.weights.signing import BadSignature, parse_public_key, verify

log = logging.getLogger(__name__)
KEY_META = "trainer_public_key"
SNAPSHOT_REQUEST_META = "snapshot_requested_at"
"""The latest version when a snapshot was last asked for; a snapshot at or after it answers it."""
SNAPSHOT_NOT_BEFORE_META = "snapshot_not_before"
"""The first version the pending request may make a snapshot: newest snapshot + min_snapshot_interval
for a worker's request, 0 for the trainer's (an operator's)."""


def manifest_name(key: ManifestKey) -> str:
    version, kind, anchor = key
    return f"v{version:08d}.{kind}.json" if anchor is None else f"v{version:08d}.{kind}-{anchor:08d}.json"


def _describe(key: ManifestKey) -> str:
    version, kind, anchor = key
    return f"v{version} {kind}" + ("" if anchor is None else f" (anchor v{anchor})")


def _sort_key(key: ManifestKey) -> tuple[int, str, int]:
    return (key[0], key[1], -1 if key[2] is None else key[2])


def _staging(stage_map: StageMap | None) -> str:
    if stage_map is None:
        return "not split into stages"
    return f"split into {stage_map.num_stages} stages ({stage_map.describe()})"


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
        self.stage_map = context.stage_map
        """The run's pipeline stages (`/v1/info`); None when not staged."""
        self._lock = threading.Lock()  # one publish at a time (there is one trainer)
        self.manifests: dict[ManifestKey, Manifest] = {}
        self._load()
        self._check_stage_map()

    def _check_stage_map(self) -> None:
        """The map is fixed for a run: the published versions name the one it started with."""
        if not self.manifests:
            return
        published = max(self.manifests.values(), key=lambda manifest: manifest.version).stage_map
        if published != self.stage_map:
            raise ConfigError(
                f"this run's published weights are {_staging(published)}, but model.num_stages / "
                f"model.stage_layers now make them {_staging(self.stage_map)}; the stage map is fixed "
                "for a run: restore the run's model settings or start a new run"
            )

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
            self.manifests[manifest.key] = manifest

    # ------------------------------------------------------------------ trainer key

    def trainer_key(self) -> str | None:
        with self.context.store.transaction() as db:
            return get_meta(db, KEY_META)

    def stage_keys(self) -> list[str | None] | None:
        """Each stage trainer's key (`stage_signed.py`); None: this run has one trainer."""
        return None

    def register_key(self, body: TrainerKey) -> dict:
        with self.context.store.transaction() as db:
            current = get_meta(db, KEY_META)
            if current is not None and current != body.public_key:
                raise ApiError(
                    409,
                    "this run's trainer key is already registered and differs; restore the trainer's "
                    "run_dir/trainer/signing_key.pem or start a new run",
                    Reason.CONFLICT,
                )
            set_meta(db, KEY_META, body.public_key)
        return {"public_key": body.public_key}

    # ------------------------------------------------------------------ uploads

    def put_chunk(self, digest: str, data: bytes) -> dict:
        if not self.chunks.put(digest, data):
            raise ApiError(422, f"chunk body does not hash to {digest}", Reason.HASH)
        return {"sha256": digest, "size": len(data)}

    def put_manifest(self, key: ManifestKey, body: bytes, stage: int | None = None) -> WeightsInfo:
        if stage is not None:
            raise ApiError(
                422, "this run has one trainer: ?stage= names a stage trainer's manifest", Reason.SCHEMA
            )
        self.refresh()  # the history may have grown through another replica
        manifest = self._checked(key, body)
        public_key = self.trainer_key()
        if public_key is None:
            raise ApiError(409, "no trainer key registered; PUT /v1/trainer/key first", Reason.CONFLICT)
        try:
            verify(manifest, parse_public_key(public_key))
        except BadSignature as error:
            raise ApiError(422, str(error), Reason.SIGNATURE) from None
        self._check_chunks(manifest)
        with self._lock:
            return self._publish(manifest)

    def _checked(self, key: ManifestKey, body: bytes) -> Manifest:
        """The manifest of an upload to `key`, parsed and structurally checked (not its signature)."""
        try:
            manifest = Manifest.model_validate_json(body)
        except ValidationError as error:
            raise ApiError(422, f"invalid manifest: {error.errors()[0]['msg']}", Reason.SCHEMA) from None
        if manifest.key != key:
            raise ApiError(
                422, f"manifest is {_describe(manifest.key)}, URL says {_describe(key)}", Reason.SCHEMA
            )
        problem = check_layout(manifest)
        if problem:
            raise ApiError(422, f"manifest v{key[0]}: {problem}", Reason.SCHEMA)
        if manifest.stage_map != self.stage_map:
            raise ApiError(
                409,
                f"manifest v{key[0]} is {_staging(manifest.stage_map)}; this run's weights are "
                f"{_staging(self.stage_map)} (publish with the stage map of GET /v1/info)",
                Reason.STAGE_MAP,
            )
        return manifest

    def _check_chunks(self, manifest: Manifest) -> None:
        """Every chunk the manifest names is stored, with its size."""
        for chunk in manifest.chunks:
            path = self.chunks.path(chunk.sha256)
            if not path.is_file() or path.stat().st_size != chunk.size:
                raise ApiError(
                    409, f"chunk {chunk.sha256} is not uploaded (or has another size)", Reason.CONFLICT
                )

    def _publish(self, manifest: Manifest) -> WeightsInfo:
        version, kind = manifest.version, manifest.kind
        with self.context.store.transaction() as db:
            row = db.execute("SELECT * FROM weights WHERE version = ?", (version,)).fetchone()
            latest = latest_version(db)
        existing = self.manifests.get(manifest.key)
        if existing is not None:
            if existing != manifest:
                raise ApiError(
                    409, f"{_describe(manifest.key)} is already published differently", Reason.CONFLICT
                )
            return _info(row)
        if kind == "patch":
            self._check_patch(manifest, row)
        if row is not None and row["sha256"] != manifest.state_sha256:
            raise ApiError(409, f"v{version} is already published with another state hash", Reason.CONFLICT)
        expected = 0 if latest is None else latest + 1
        if row is None and version != expected:
            raise ApiError(
                409, f"cannot publish v{version}: the next version must be {expected}", Reason.CONFLICT
            )
        if (
            row is None
            and kind == "delta"
            and not self._stored(manifest.parent, manifest.parent_state_sha256)
        ):
            raise ApiError(
                409, f"delta v{version} does not apply to the stored v{version - 1}", Reason.CONFLICT
            )
        if row is None and version == 0 and kind != "snapshot":
            raise ApiError(409, "version 0 must be a snapshot", Reason.CONFLICT)
        self._write(manifest)
        with self.context.store.transaction() as db:
            if row is None:
                db.execute(
                    "INSERT INTO weights (version, path, sha256, num_bytes, created) VALUES (?, ?, ?, ?, ?)",
                    (
                        version,
                        manifest_name(manifest.key),
                        manifest.state_sha256,
                        manifest.payload_bytes,
                        self.context.clock(),
                    ),
                )
            self.manifests[manifest.key] = manifest
            self._prune(db)
            row = db.execute("SELECT * FROM weights WHERE version = ?", (version,)).fetchone()
        return _info(row)

    def _stored(self, version: int | None, state_sha256: str | None) -> bool:
        """Whether `version` was published (pruned or not) with this state hash."""
        with self.context.store.transaction() as db:
            row = db.execute("SELECT sha256 FROM weights WHERE version = ?", (version,)).fetchone()
        return row is not None and row["sha256"] == state_sha256

    def _check_patch(self, manifest: Manifest, row: sqlite3.Row | None) -> None:
        """A patch only adds a route to a published version (so every retained version stays
        reachable from nothing) and must start from history the coordinator holds."""
        if row is None:
            raise ApiError(
                409, f"publish v{manifest.version}'s delta or snapshot before its patches", Reason.CONFLICT
            )
        if row["sha256"] != manifest.state_sha256:
            raise ApiError(
                409, f"v{manifest.version} is already published with another state hash", Reason.CONFLICT
            )
        if not self._stored(manifest.anchor, manifest.anchor_state_sha256):
            raise ApiError(
                409,
                f"patch v{manifest.version} names an anchor v{manifest.anchor} state never published",
                Reason.CONFLICT,
            )

    def _write(self, manifest: Manifest, name: str | None = None) -> None:
        """The manifest's file, durably (`name`: a stage trainer's, `stage_signed.py`)."""
        final = self.manifest_dir / (name or manifest_name(manifest.key))
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
        versions = {key[0] for key in self.manifests}
        if not versions:
            return 0
        start = max(versions) - self.keep_versions + 1
        snapshots = [v for v, kind, _ in self.manifests if kind == "snapshot" and v <= start]
        return min(start, max(snapshots)) if snapshots else min(versions)

    def _prune(self, db: Connection) -> None:
        oldest = self.retained_from()
        for key in [key for key in self.manifests if key[0] < oldest]:
            del self.manifests[key]
            (self.manifest_dir / manifest_name(key)).unlink(missing_ok=True)
            db.execute("UPDATE weights SET pruned = 1 WHERE version = ?", (key[0],))
        wanted = {chunk.sha256 for manifest in self.manifests.values() for chunk in manifest.chunks}
        for digest in self.chunks.digests() - wanted:
            self.chunks.remove(digest)

    # ------------------------------------------------------------------ on-demand snapshots

    def _newest_snapshot(self) -> int | None:
        return max((key[0] for key in self.manifests if key[1] == "snapshot"), default=None)

    def request_snapshot(self, by: str) -> dict:
        """Ask the trainer for a full snapshot with its next version, unless the latest version
        already is one. Idempotent: one pending request, however many ask. A worker's request is
        answered no sooner than `weights.min_snapshot_interval` versions after the newest snapshot
        (`next_at`), so that asking after every version cannot turn deltas into snapshots."""
        with self._lock, self.context.store.transaction() as db:
            latest = latest_version(db)
            if latest is None:
                raise ApiError(409, "no version is published yet", Reason.CONFLICT)
            newest = self._newest_snapshot()
            if newest is not None and newest >= latest:
                return {"pending": False, "snapshot": newest, "next_at": None}
            interval = (
                0
                if by == "trainer" or newest is None
                else newest + self.context.run.weights.min_snapshot_interval
            )
            pending = get_meta(db, SNAPSHOT_REQUEST_META)
            if pending is None or newest is None or int(pending) <= newest:
                set_meta(db, SNAPSHOT_REQUEST_META, str(latest))
                set_meta(db, SNAPSHOT_NOT_BEFORE_META, str(interval))
                log.info("snapshot requested by %s at v%d (newest snapshot: v%s)", by, latest, newest)
            elif interval < int(get_meta(db, SNAPSHOT_NOT_BEFORE_META) or 0):
                set_meta(db, SNAPSHOT_NOT_BEFORE_META, str(interval))  # the operator's ask wins
            not_before = int(get_meta(db, SNAPSHOT_NOT_BEFORE_META) or 0)
        return {"pending": True, "snapshot": newest, "next_at": max(latest + 1, not_before)}

    def snapshot_requested(self) -> bool:
        """Whether a request is pending (no snapshot at or after the version it was made at) and the
        trainer's next version may answer it."""
        with self.context.store.transaction() as db:
            pending = get_meta(db, SNAPSHOT_REQUEST_META)
            not_before = int(get_meta(db, SNAPSHOT_NOT_BEFORE_META) or 0)
            latest = latest_version(db)
        newest = self._newest_snapshot()
        waiting = pending is not None and (newest is None or newest < int(pending))
        return waiting and (latest is None or latest + 1 >= not_before)

    # ------------------------------------------------------------------ reads

    def latest(self) -> WeightsInfo | None:
        with self.context.store.transaction() as db:
            row = db.execute("SELECT * FROM weights ORDER BY version DESC LIMIT 1").fetchone()
        return None if row is None else _info(row)

    def refresh(self) -> None:
        """Pick up manifests that another coordinator replica of the run published or pruned (they
        share the run directory). A manifest file is complete before its version's row commits, so
        a file above the committed latest version is a publish in flight and waits for the next call."""
        names = {path.name for path in self.manifest_dir.iterdir() if not path.name.startswith(".")}
        known = {manifest_name(key): key for key in self.manifests}
        if names == known.keys():
            return
        with self.context.store.transaction() as db:
            latest = latest_version(db)
        for name in names - known.keys():
            try:
                manifest = Manifest.model_validate_json((self.manifest_dir / name).read_bytes())
            except (FileNotFoundError, ValidationError):  # pruned or replaced meanwhile: next call
                continue
            if latest is not None and manifest.version <= latest:
                self.manifests[manifest.key] = manifest
        for name in known.keys() - names:
            self.manifests.pop(known[name], None)

    def index(self) -> list[WeightsEntry]:
        self.refresh()
        return [
            index_entry(manifest)
            for _, manifest in sorted(self.manifests.items(), key=lambda item: _sort_key(item[0]))
        ]

    def stage_manifest(self, key: ManifestKey, stage: int | None) -> Manifest:
        """The manifest of `key`; `stage` names a stage trainer's, which this run has none of."""
        if stage is not None:
            raise ApiError(404, "this run has one trainer: its manifests carry no ?stage=", Reason.UNKNOWN)
        return self.manifest(key)

    def manifest(self, key: ManifestKey) -> Manifest:
        if key not in self.manifests:
            self.refresh()
        manifest = self.manifests.get(key)
        version = key[0]
        if manifest is not None:
            return manifest
        latest = self.latest()
        if latest is None or version > latest.version:
            raise ApiError(404, f"weights version {version} was never published", Reason.UNKNOWN_VERSION)
        if version < self.retained_from():
            raise ApiError(410, f"weights version {version} was pruned; fetch a newer version", Reason.PRUNED)
        raise ApiError(404, f"there is no {_describe(key)} (see GET /v1/weights/index)", Reason.UNKNOWN)

    def chunk_path(self, digest: str) -> Path:
        if len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
            raise ApiError(422, "a chunk name is 64 lowercase hex digits", Reason.SCHEMA)
        path = self.chunks.path(digest)
        if not path.is_file():
            raise ApiError(404, f"no chunk {digest}", Reason.UNKNOWN_CHUNK)
        return path
