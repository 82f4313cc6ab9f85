"""A token bucket shared by all connections of one uploader (the coordinator or a peer).

Each sender reserves the bytes it is about to send and sleeps for as long as the bucket is in
debt, so N concurrent downloads share the configured rate instead of each getting it.
"""

from __future__ import annotations

import threading
import time

PIECE_BYTES = 64 << 10
"""Granularity at which throttled senders write (small against a chunk, large against a syscall)."""


class TokenBucket:
    def __init__(self, bytes_per_second: float, burst_bytes: float | None = None):
        assert bytes_per_second > 0
        self.rate = bytes_per_second
        self.capacity = burst_bytes if burst_bytes is not None else max(PIECE_BYTES, bytes_per_second / 20)
        self._level = self.capacity
        self._time = time.monotonic()
        self._lock = threading.Lock()

    def reserve(self, num_bytes: int) -> float:
        """Take `num_bytes` now; return how long to wait before sending them (0 when in budget)."""
        with self._lock:
            now = time.monotonic()
            self._level = min(self.capacity, self._level + (now - self._time) * self.rate)
            self._time = now
            self._level -= num_bytes
            return max(0.0, -self._level / self.rate)

    def pieces(self, data: bytes) -> list[memoryview]:
        view = memoryview(data)
        return [view[i : i + PIECE_BYTES] for i in range(0, len(data), PIECE_BYTES)]
