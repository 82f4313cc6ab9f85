"""Replay protection for signed requests: a timestamp window plus a record of seen nonces.

A request is fresh when its timestamp lies within `max_skew` seconds of the coordinator's clock and
its nonce was not seen in that window. Nonces only need remembering for the window (an older
timestamp is refused anyway). Recent ones are kept in memory; those of state-changing requests are
also written through `remember` (the coordinator's store), so a request captured before a restart
cannot be sent again after it. A GET changes nothing, so it is checked against memory only.

A refusal here never counts against the worker: anybody can replay a captured request, and an
honest worker's clock can be wrong. A timestamp outside the window is answered with the server's
time, so that the client can correct its clock and sign again (`identity.Signer.offset`).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

CLOCK_SKEW = "clock_skew"
REPLAY = "replay"
MALFORMED = "bad_signature"

Remember = Callable[[str, str, float], bool]
"""(identity, nonce, expires) -> False when the pair was already recorded."""


@dataclass(frozen=True)
class Refusal:
    reason: str
    """`clock_skew`, `replay` or `bad_signature` (a malformed timestamp or nonce)."""
    detail: str


class ReplayGuard:
    def __init__(self, max_skew: float, remember: Remember | None = None) -> None:
        self.max_skew = max_skew
        self.remember = remember
        self._seen: set[tuple[str, str]] = set()
        self._expiry: deque[tuple[float, str, str]] = deque()
        self._lock = threading.Lock()

    def check(
        self, identity: str, timestamp: str, nonce: str, now: float, durable: bool = False
    ) -> Refusal | None:
        """None when fresh (and remembered: in the store too when `durable`); else why not."""
        try:
            sent = float(timestamp)
        except ValueError:
            return Refusal(MALFORMED, "malformed signature timestamp")
        if not 16 <= len(nonce) <= 64:
            return Refusal(MALFORMED, "nonce must be 16-64 characters")
        if not math.isfinite(sent) or abs(now - sent) > self.max_skew:
            detail = (
                f"signature timestamp {timestamp} is more than {self.max_skew:.0f}s from the server clock"
                f" ({now:.3f}); correct the clock (decentrl clients adjust to the server time given here)"
            )
            return Refusal(CLOCK_SKEW, detail)
        expires = now + 2 * self.max_skew
        with self._lock:
            while self._expiry and self._expiry[0][0] < now:
                _, old_identity, old_nonce = self._expiry.popleft()
                self._seen.discard((old_identity, old_nonce))
            if (identity, nonce) in self._seen:
                return Refusal(REPLAY, "replayed request (nonce already used); sign every request afresh")
            self._seen.add((identity, nonce))
            self._expiry.append((expires, identity, nonce))
        if durable and self.remember is not None and not self.remember(identity, nonce, expires):
            return Refusal(REPLAY, "replayed request (nonce already used); sign every request afresh")
        return None
