"""Published weight versions: full safetensors snapshots in `run_dir/weights/`.

The trainer PUTs version v+1 with the body's sha256 in `X-Content-SHA256`. The body is streamed
to a temporary file while hashing (weights may not fit the memory budget of a request), fsynced
and renamed into place before the database row is committed, so a listed version always has a
complete file. Only the newest `keep_versions` files stay on disk; older rows are marked pruned.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from decentrl.coordinator.context import ApiError, Context
from decentrl.coordinator.store import latest_version
from decentrl.protocol import WeightsInfo

UPLOAD_PREFIX = ".upload-"


@dataclass(frozen=True)
class Upload:
    path: Path
    sha256: str
    num_bytes: int


def file_name(version: int) -> str:
    return f"v{version:06d}.safetensors"


def _info(row: sqlite3.Row) -> WeightsInfo:
    return WeightsInfo(
        version=row["version"], sha256=row["sha256"], num_bytes=row["num_bytes"], created_unix=row["created"]
    )


def next_version(db: sqlite3.Connection) -> int:
    latest = latest_version(db)
    return 0 if latest is None else latest + 1


def check_version(context: Context, version: int, sha256: str) -> bool:
    """True when `version` is already stored with this hash (an idempotent re-PUT); 409 if not allowed."""
    with context.store.transaction() as db:
        row = db.execute("SELECT sha256 FROM weights WHERE version = ?", (version,)).fetchone()
        expected = next_version(db)
    if row is not None:
        if row["sha256"] != sha256:
            raise ApiError(409, f"version {version} is already published with a different sha256", "conflict")
        return True
    if version != expected:
        raise ApiError(
            409, f"cannot publish version {version}: the next version must be {expected}", "conflict"
        )
    return False


def remove_partial_uploads(context: Context) -> None:
    """Delete uploads a crash interrupted (they never had a database row)."""
    for path in context.weights_dir.glob(f"{UPLOAD_PREFIX}*"):
        path.unlink()


async def receive(context: Context, chunks: AsyncIterator[bytes], limit: int) -> Upload:
    """Stream a body into a temporary file in the weights directory, hashing it on the way."""
    context.weights_dir.mkdir(parents=True, exist_ok=True)
    descriptor, name = tempfile.mkstemp(prefix=UPLOAD_PREFIX, dir=context.weights_dir)
    digest, size = hashlib.sha256(), 0
    try:
        with os.fdopen(descriptor, "wb") as handle:
            async for chunk in chunks:
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"weights body exceeds the limit of {limit} bytes", "oversized")
                digest.update(chunk)
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        os.unlink(name)
        raise
    return Upload(Path(name), digest.hexdigest(), size)


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def publish(context: Context, version: int, upload: Upload) -> WeightsInfo:
    """Move a verified upload into place, commit its row, prune old files."""
    final = context.weights_dir / file_name(version)
    with context.store.transaction() as db:
        expected = next_version(db)
        if version != expected:  # a concurrent PUT won the race
            upload.path.unlink()
            raise ApiError(
                409, f"cannot publish version {version}: the next version must be {expected}", "conflict"
            )
        os.replace(upload.path, final)
        _fsync_dir(context.weights_dir)
        db.execute(
            "INSERT INTO weights (version, path, sha256, num_bytes, created) VALUES (?, ?, ?, ?, ?)",
            (version, final.name, upload.sha256, upload.num_bytes, context.clock()),
        )
        _prune(db, context)
        row = db.execute("SELECT * FROM weights WHERE version = ?", (version,)).fetchone()
    return _info(row)


def _prune(db: sqlite3.Connection, context: Context) -> None:
    old = db.execute(
        "SELECT version, path FROM weights WHERE pruned = 0 ORDER BY version DESC LIMIT -1 OFFSET ?",
        (context.keep_versions,),
    ).fetchall()
    for row in old:
        (context.weights_dir / row["path"]).unlink(missing_ok=True)
        db.execute("UPDATE weights SET pruned = 1 WHERE version = ?", (row["version"],))


def latest(context: Context) -> WeightsInfo | None:
    with context.store.transaction() as db:
        row = db.execute("SELECT * FROM weights ORDER BY version DESC LIMIT 1").fetchone()
    return None if row is None else _info(row)


def version_info(context: Context, version: int) -> WeightsInfo:
    with context.store.transaction() as db:
        row = db.execute("SELECT * FROM weights WHERE version = ?", (version,)).fetchone()
    return _info(row)


def stored_file(context: Context, version: int) -> tuple[Path, str]:
    """Path and sha256 of a version's file; 404 when never published, 410 when pruned."""
    with context.store.transaction() as db:
        row = db.execute("SELECT path, sha256, pruned FROM weights WHERE version = ?", (version,)).fetchone()
    if row is None:
        raise ApiError(404, f"weights version {version} was never published", "unknown_version")
    if row["pruned"]:
        raise ApiError(410, f"weights version {version} was pruned; fetch a newer version", "pruned")
    return context.weights_dir / row["path"], row["sha256"]
