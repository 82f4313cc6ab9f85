"""The budget of requests in flight: overall, per client, and for addresses that fail to authenticate.

Every request holds one unit of `service.max_requests_in_flight` while its handler runs.
Requests from callers the coordinator does not know yet (registrations, unknown or junk tokens,
`/metrics`) may use all but `service.reserved_requests` of it; requests that carry a bearer token
which already authenticated (a worker that passed its signature check, or the trainer) may use
all of it, and `/v1/health` is never refused. Within that, one bearer token holds at most
`service.max_requests_per_token` units (the trainer's token, shared by the trusted helper roles,
is exempt) and the requests of one address without an authenticated token at most
`service.max_requests_per_address`, taken here, before the body is read: a client that trickles
hundreds of bodies holds its own share only.
An address whose failed authentications used up `trust.failed_auths_per_address_per_minute`
gets 429 here, a second late, for any token not known yet, so a flood of made-up tokens costs no
store lookup and comes back at most once a second per connection.
Over a share a request is answered 503 (429) with `Retry-After` before any work, which every
decentrl client retries. Deciding costs one sha256 of the token and a few dictionary lookups.
An answer the gate marks with `TARPIT_HEADER` (the refusal of an address whose junk signatures,
replays or unknown tokens used up its allowance, whatever token it sends) is held here for
`TARPIT_SECONDS` after its handler returned, holding no part of the budget: a sender that waits
for its answers gets one a second per connection, and a victim's token that the requests carry
keeps its share.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections import Counter

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from decentrl.config import ServiceConfig
from decentrl.protocol import API_PREFIX
from decentrl.trust.ratelimit import RateLimiter

HEALTH_PATH = f"{API_PREFIX}/health"
FAILED_AUTH_BURST_MIN = 10
TARPIT_SECONDS = 1.0
"""How long the refusal of an address out of failed authentications, or an answer the gate marked
(`TARPIT_HEADER`), waits before it is sent."""
TARPIT_HEADER = "x-decentrl-tarpit"
"""Set by the gate on an answer this middleware sends `TARPIT_SECONDS` late (and strips)."""
BUSY_BODY = b'{"detail":"the coordinator is at its request budget; retry shortly"}'
CLIENT_BUSY_BODY = b'{"detail":"too many of your requests are in flight; wait for their answers"}'
AUTH_FAILED_BODY = (
    b'{"detail":"too many failed authentications from this address; check the token and retry later"}'
)


class KnownTokens:
    """sha256 of bearer tokens that authenticated, bounded (the oldest are forgotten first); the
    requests each client holds; the failed authentications of each address; and the budget's
    counters (for `/v1/stats` and `/metrics`)."""

    def __init__(self, limit: int = 100_000, failed_auths_per_minute: float = 30.0) -> None:
        self.limit = limit
        self._hashes: dict[str, None] = {}
        self.trusted: set[str] = set()
        """Token hashes of the trusted roles (the trainer's), exempt from the per-client shares."""
        # A burst of a tenth of the minute's allowance: a typo costs little, and a flood from many
        # addresses reaches the store a few times per address, not a minute's worth each at once.
        burst = max(FAILED_AUTH_BURST_MIN, failed_auths_per_minute / 10)
        self.failed_auths = RateLimiter(failed_auths_per_minute / 60.0, burst)
        self.failed_auth_retry = max(1, math.ceil(60.0 / failed_auths_per_minute))
        """Seconds until an address that used up its failed authentications may try one more."""
        self.tarpit_seconds = TARPIT_SECONDS
        self.holding: Counter[str] = Counter()
        """Requests in flight per client: `token:<sha256>` and `address:<host>`."""
        self.in_flight = 0
        self.refused = 0
        self.refused_per_client = 0
        self.refused_failed_auth = 0
        self.tarpitted = 0
        """Answers the gate marked to be sent late (`TARPIT_HEADER`)."""
        self.client_disconnects = 0
        self._disconnects_logged = -math.inf

    def disconnected(self) -> bool:
        """Count a client that left before its request was read; True when that deserves a log
        line (at most one a minute: a client may leave on purpose, thousands of times)."""
        self.client_disconnects += 1
        if time.monotonic() - self._disconnects_logged < 60.0:
            return False
        self._disconnects_logged = time.monotonic()
        return True

    def add(self, token_sha256: str) -> None:
        self._hashes[token_sha256] = None
        if len(self._hashes) > self.limit:
            del self._hashes[next(iter(self._hashes))]

    def trust(self, token_sha256: str) -> None:
        self.trusted.add(token_sha256)
        self.add(token_sha256)

    def discard(self, token_sha256: str) -> None:
        self._hashes.pop(token_sha256, None)

    def __contains__(self, token_sha256: str) -> bool:
        return token_sha256 in self._hashes

    def auth_failed(self, address: str) -> None:
        """Charge one failed authentication to `address` (the gate calls it on each 401)."""
        self.failed_auths.charge(address, time.monotonic(), 1.0)

    def stats(self) -> dict:
        return {
            "in_flight": self.in_flight,
            "refused_busy": self.refused,
            "refused_per_client": self.refused_per_client,
            "refused_failed_auth": self.refused_failed_auth,
            "tarpitted": self.tarpitted,
            "client_disconnects": self.client_disconnects,
        }


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

    def _shares(self, token: str | None, authenticated: bool, address: str) -> dict[str, int]:
        """The per-client keys this request is charged to, with their caps. An authenticated token
        is held to its own share only: workers launched on one machine, or behind one NAT, share an
        address; a proxy's clients are told apart by token too."""
        if token is not None and token in self.known.trusted:
            return {}
        shares = {} if token is None else {f"token:{token}": self.config.max_requests_per_token}
        if not authenticated and address not in self.config.trusted_proxies:
            shares[f"address:{address}"] = self.config.max_requests_per_address
        return shares

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == HEALTH_PATH:
            await self.app(scope, receive, send)
            return
        known, token = self.known, bearer_sha256(scope)
        address = scope["client"][0] if scope.get("client") else ""
        authenticated = token is not None and token in known
        if not authenticated and known.failed_auths.exhausted(address, time.monotonic()):
            # Before routing and without touching the store; the answer waits (a sleeping coroutine
            # costs nothing), so a sender that waits for answers gets one a second per connection.
            known.refused_failed_auth += 1
            await asyncio.sleep(known.tarpit_seconds)
            await _refuse(send, 429, AUTH_FAILED_BODY, known.failed_auth_retry)
            return
        limit = self.config.max_requests_in_flight
        if not authenticated:
            limit -= self.config.reserved_requests
        if known.in_flight >= limit:
            known.refused += 1
            await _refuse(send, 503, BUSY_BODY)
            return
        shares = self._shares(token, authenticated, address)
        if any(known.holding[key] >= cap for key, cap in shares.items()):
            known.refused_per_client += 1
            await _refuse(send, 503, CLIENT_BUSY_BODY)
            return
        known.in_flight += 1
        known.holding.update(shares.keys())
        held: list[Message] = []

        async def send_or_hold(message: Message) -> None:
            if held or (message["type"] == "http.response.start" and _tarpit(message)):
                held.append(message)
            else:
                await send(message)

        try:
            await self.app(scope, receive, send_or_hold)
        finally:
            known.in_flight -= 1
            known.holding.subtract(shares.keys())
            for key in shares:
                if known.holding[key] <= 0:
                    del known.holding[key]
        if held:  # the budget is released: the wait holds a sleeping coroutine and its connection
            known.tarpitted += 1
            await asyncio.sleep(known.tarpit_seconds)
            for message in held:
                await send(message)


def _tarpit(start: Message) -> bool:
    """Whether a response start carries `TARPIT_HEADER`; the header is removed from it."""
    name = TARPIT_HEADER.encode()
    headers = list(start.get("headers", ()))
    kept = [(key, value) for key, value in headers if key.lower() != name]
    if len(kept) == len(headers):
        return False
    start["headers"] = kept
    return True


async def _refuse(send: Send, status: int, body: bytes, retry_after: int = 1) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"retry-after", str(retry_after).encode()),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
