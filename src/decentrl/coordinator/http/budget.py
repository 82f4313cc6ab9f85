"""The global budget of requests in flight, with room kept for known clients and `/v1/health`.

Every request holds one unit of `service.max_requests_in_flight` while its handler runs.
Requests from callers the coordinator does not know yet (registrations, unknown or junk tokens,
`/metrics`) may use all but `service.reserved_requests` of it; requests that carry a bearer token
which already authenticated (a worker that passed its signature check, or the trainer) may use
all of it, and `/v1/health` is never refused. Over its share a request is answered 503 with
`Retry-After` before any work, which every decentrl client retries. Deciding costs one sha256 of
the token and a set lookup: nothing touches the store.
"""

from __future__ import annotations

import hashlib

from starlette.types import ASGIApp, Receive, Scope, Send

from decentrl.config import ServiceConfig
from decentrl.protocol import API_PREFIX

HEALTH_PATH = f"{API_PREFIX}/health"
BUSY_BODY = b'{"detail":"the coordinator is at its request budget; retry shortly"}'


class KnownTokens:
    """sha256 of bearer tokens that authenticated, bounded (the oldest are forgotten first), and
    the budget's counters (for `/v1/stats`)."""

    def __init__(self, limit: int = 100_000) -> None:
        self.limit = limit
        self._hashes: dict[str, None] = {}
        self.in_flight = 0
        self.refused = 0

    def add(self, token_sha256: str) -> None:
        self._hashes[token_sha256] = None
        if len(self._hashes) > self.limit:
            del self._hashes[next(iter(self._hashes))]

    def discard(self, token_sha256: str) -> None:
        self._hashes.pop(token_sha256, None)

    def __contains__(self, token_sha256: str) -> bool:
        return token_sha256 in self._hashes


def bearer_sha256(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return hashlib.sha256(token.strip().encode()).hexdigest()
    return None


class RequestBudget:
    """ASGI middleware applying the budget; `known` says whether a token hash belongs to a known
    client (the trainer's token hash is added to it at start)."""

    def __init__(self, app: ASGIApp, config: ServiceConfig, known: KnownTokens) -> None:
        assert 0 <= config.reserved_requests < config.max_requests_in_flight
        self.app = app
        self.config = config
        self.known = known

    def _limit(self, scope: Scope) -> int | None:
        if scope["path"] == HEALTH_PATH:
            return None
        token = bearer_sha256(scope)
        if token is not None and token in self.known:
            return self.config.max_requests_in_flight
        return self.config.max_requests_in_flight - self.config.reserved_requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self._limit(scope)
        known = self.known
        if limit is not None and known.in_flight >= limit:
            known.refused += 1
            await _busy(send)
            return
        known.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            known.in_flight -= 1


async def _busy(send: Send) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"retry-after", b"1"),
        (b"content-length", str(len(BUSY_BODY)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": BUSY_BODY})
