"""Content-addressed chunks: cutting a payload, and a directory that stores chunks by sha256.

Both the coordinator and every worker keep their chunks in a `ChunkStore`; a chunk is only ever
written after its bytes hashed to its name, so whatever a store serves is what the signed
manifest names. No torch: the coordinator uses this module.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from decentrl.weights.manifest import ChunkEntry, Manifest

DEFAULT_CHUNK_BYTES = 4 << 20
PARTIAL_PREFIX = ".partial-"


def sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def cut(
    payload: bytes, chunk_bytes: int = DEFAULT_CHUNK_BYTES, boundaries: Iterable[int] = ()
) -> list[tuple[ChunkEntry, memoryview]]:
    """The payload as consecutive chunks of at most `chunk_bytes`, each with its entry; no chunk
    spans one of `boundaries` (a staged payload's stage groups)."""
    assert chunk_bytes > 0
    view = memoryview(payload)
    edges = sorted({0, len(payload), *boundaries})
    pieces = []
    for start, end in zip(edges, edges[1:], strict=False):
        for offset in range(start, end, chunk_bytes):
            piece = view[offset : min(offset + chunk_bytes, end)]
            pieces.append((ChunkEntry(sha256=sha256(piece), offset=offset, size=len(piece)), piece))
    return pieces


class ChunkStore:
    """Chunks as files `root/ab/abcdef...`, written atomically (temp file, fsync, rename)."""

    def __init__(self, root: Path, durable: bool = True):
        self.root = root
        self.durable = durable
        self.root.mkdir(parents=True, exist_ok=True)
        for path in self.root.glob(f"*/{PARTIAL_PREFIX}*"):  # left by a crash mid-write
            path.unlink(missing_ok=True)

    def path(self, digest: str) -> Path:
        assert len(digest) == 64 and all(c in "0123456789abcdef" for c in digest), digest
        return self.root / digest[:2] / digest

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def get(self, digest: str) -> bytes:
        return self.path(digest).read_bytes()

    def put(self, digest: str, data: bytes | memoryview) -> bool:
        """Store `data` under `digest` if it hashes to it; False (nothing stored) when it does not."""
        if sha256(data) != digest:
            return False
        final = self.path(digest)
        if final.is_file():
            return True
        final.parent.mkdir(exist_ok=True)
        descriptor, name = tempfile.mkstemp(prefix=PARTIAL_PREFIX, dir=final.parent)
        try:
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(data)
                if self.durable:
                    handle.flush()
                    os.fsync(handle.fileno())
            os.replace(name, final)
        except BaseException:
            Path(name).unlink(missing_ok=True)
            raise
        if self.durable:
            _fsync_dir(final.parent)
        return True

    def missing(self, chunks: Iterable[ChunkEntry]) -> list[ChunkEntry]:
        return [chunk for chunk in chunks if not self.has(chunk.sha256)]

    def payload(self, manifest: Manifest) -> bytes:
        """The manifest's whole payload from stored chunks (each must be present)."""
        return self.join(manifest.chunks)

    def join(self, chunks: Iterable[ChunkEntry]) -> bytes:
        """The stored chunks, one after the other (each must be present)."""
        return b"".join(self.get(chunk.sha256) for chunk in chunks)

    def digests(self) -> set[str]:
        return {path.name for path in self.root.glob("*/*") if not path.name.startswith(PARTIAL_PREFIX)}

    def remove(self, digest: str) -> None:
        self.path(digest).unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
