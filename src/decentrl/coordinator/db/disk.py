"""Free space of the run directory: refuse new work with 507 before SQLite runs out of disk.

A full disk makes every write fail (SQLite: "database or disk is full"), which the routes would
answer with 500 while `/v1/health` still says ok. The guard reads the file system's free space at
most once a second and, below `service.min_free_disk_mb`, makes `/v1/health` report unhealthy
and leases and submissions answer 507 with a detail naming the fix. Work already accepted stays
servable: batches, acks and weight downloads go on, and they are what frees space.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from decentrl.coordinator.http.errors import ApiError, Reason

CHECK_SECONDS = 1.0


class DiskGuard:
    def __init__(self, path: Path, min_free_bytes: int) -> None:
        self.path = path
        self.min_free_bytes = min_free_bytes
        self._checked = -CHECK_SECONDS
        self._free = 0
        self._lock = threading.Lock()

    def free_bytes(self) -> int:
        with self._lock:
            now = time.monotonic()
            if now - self._checked >= CHECK_SECONDS:
                stat = os.statvfs(self.path)
                self._free, self._checked = stat.f_bavail * stat.f_frsize, now
            return self._free

    def low(self) -> bool:
        return self.free_bytes() < self.min_free_bytes

    def check(self) -> None:
        """Raise 507 when the run directory's file system is below its free-space floor."""
        free = self.free_bytes()
        if free < self.min_free_bytes:
            raise ApiError(
                507,
                f"the coordinator's disk has {free >> 20} MiB free, below service.min_free_disk_mb="
                f"{self.min_free_bytes >> 20}; the operator must free space in {self.path}",
                Reason.DISK_FULL,
            )
