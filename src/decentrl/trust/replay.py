"""Replay protection for signed requests: a timestamp window plus a cache of seen nonces.

A request is fresh when its timestamp lies within `max_skew` seconds of the coordinator's clock and
its nonce was not seen in that window. Nonces only need remembering for the window (an older
timestamp is refused anyway), so the cache stays small. It lives in memory: after a restart,
timestamps from before the start are refused, so a request captured earlier cannot be replayed
into the new process (honest clients sign every retry afresh).
"""

from __future__ import annotations

import math
import threading
from collections import deque


class ReplayGuard:
    def __init__(self, max_skew: float, started: float) -> None:
        self.max_skew = max_skew
        self.started = started
        self._seen: set[tuple[str, str]] = set()
        self._expiry: deque[tuple[float, str, str]] = deque()
        self._lock = threading.Lock()

    def check(self, identity: str, timestamp: str, nonce: str, now: float) -> str | None:
        """None when fresh (and remember it); otherwise why the request is refused."""
        try:
            sent = float(timestamp)
        except ValueError:
            return "malformed signature timestamp"
        if not math.isfinite(sent) or abs(now - sent) > self.max_skew:
            return f"signature timestamp {timestamp} is more than {self.max_skew:.0f}s from the server clock"
        if sent < self.started:
            return "signature timestamp predates the coordinator's start; sign the request again"
        if not 16 <= len(nonce) <= 64:
            return "nonce must be 16-64 characters"
        with self._lock:
            while self._expiry and self._expiry[0][0] < now:
                _, old_identity, old_nonce = self._expiry.popleft()
                self._seen.discard((old_identity, old_nonce))
            if (identity, nonce) in self._seen:
                return "replayed request (nonce already used)"
            self._seen.add((identity, nonce))
            self._expiry.append((now + 2 * self.max_skew, identity, nonce))
        return None
