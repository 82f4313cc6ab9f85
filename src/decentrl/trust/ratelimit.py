"""Token-bucket rate limits, one bucket per key (a worker id, or a network address).

In memory: a limit protects the coordinator from a flood now, it is not an account balance.
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
