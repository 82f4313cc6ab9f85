"""Token-bucket rate limits, one bucket per key (a worker id, or a network address).

Buckets live in memory; the coordinator saves the ones below their burst every few seconds
(`snapshot`, `restore`), so a restart does not hand every worker a fresh burst.
"""

from __future__ import annotations

import threading


class RateLimiter:
    def __init__(self, rate: float, burst: float, max_keys: int = 100_000) -> None:
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def exhausted(self, key: str, now: float) -> bool:
        """True when `key` could not afford one request now (nothing is taken)."""
        with self._lock:
            tokens, last = self._buckets.get(key, (self.burst, now))
            return min(self.burst, tokens + max(0.0, now - last) * self.rate) < 1.0

    def allow(self, key: str, now: float, cost: float = 1.0) -> bool:
        """Take `cost` tokens from `key`'s bucket; False (nothing taken) when it holds fewer."""
        with self._lock:
            tokens, last = self._buckets.get(key, (self.burst, now))
            tokens = min(self.burst, tokens + max(0.0, now - last) * self.rate)
            allowed = tokens >= cost
            # Concurrent requests may arrive here out of clock order: never move `last` back, or
            # the interval between the two clock readings would be refilled twice.
            self._buckets[key] = (tokens - cost if allowed else tokens, max(last, now))
            if len(self._buckets) > self.max_keys:  # forget the fullest buckets first: they are idle
                for idle in [k for k, (t, _) in self._buckets.items() if t >= self.burst][
                    : self.max_keys // 10
                ]:
                    del self._buckets[idle]
            return allowed

    def charge(self, key: str, now: float, cost: float) -> None:
        """Take `cost` from `key`'s bucket even past empty (a cost known only afterwards)."""
        with self._lock:
            tokens, last = self._buckets.get(key, (self.burst, now))
            tokens = min(self.burst, tokens + max(0.0, now - last) * self.rate)
            self._buckets[key] = (tokens - cost, max(last, now))

    def snapshot(self) -> dict[str, tuple[float, float]]:
        """Buckets that are not full (a full one is the same as none)."""
        with self._lock:
            return {key: value for key, value in self._buckets.items() if value[0] < self.burst}

    def restore(self, buckets: dict[str, tuple[float, float]]) -> None:
        with self._lock:
            self._buckets.update(buckets)
