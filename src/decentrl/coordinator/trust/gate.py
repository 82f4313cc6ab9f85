"""Admission of worker requests: token, quarantine, rate limits, signature and replay, in that order.

Each refusal is a 4xx whose detail names the fix and stores nothing but a `rejected` event, at
most one a second per (address or worker, reason), so a flood cannot turn into a flood of disk
writes. None of these refusals is a strike: a bearer token, a captured request or a wrong clock
is all they prove, and anyone holding a token or a copy of a request can cause them. Strikes are
for what a valid signature binds to the key holder (the body of a signed request, `ingest.py`).
A timestamp outside the allowed skew is answered with the server's time in
`X-Decentrl-Server-Time`, so that the client can correct its clock and sign again. Weight-chunk downloads have their own, larger allowance
(`trust.chunk_requests_per_second`): a worker that fetches a snapshot of hundreds of chunks must not
spend the budget its leases and submissions need.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from decentrl.coordinator.context import Context
from decentrl.coordinator.db.store import load_buckets, remember_nonce, save_buckets
from decentrl.coordinator.http.budget import TARPIT_HEADER, KnownTokens
from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.coordinator.trust import reputation
from decentrl.coordinator.trust.auth import bearer_token, hash_token, same_token
from decentrl.protocol import API_PREFIX, SERVER_TIME_HEADER
from decentrl.trust.identity import (
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    signature_valid,
    signed_message,
)
from decentrl.trust.ratelimit import RateLimiter
from decentrl.trust.replay_guard import ReplayGuard

CHUNK_PATH = f"{API_PREFIX}/weights/chunks/"
RELAY_PATH = f"{API_PREFIX}/relay/"
OVERSIZED_ANSWER_DELAY = 1.0
BodyReader = Callable[[Request, int], Awaitable[bytes]]
BodyLimit = Callable[[Request, str], Awaitable[int]]
"""Bytes the body of a worker's request may take (`scoring_budget.submission_limit` for rollouts)."""


class Gate:
    def __init__(
        self, context: Context, read_body: BodyReader, known: KnownTokens, body_limit: BodyLimit
    ) -> None:
        trust = context.run.trust
        self.context = context
        self.trust = trust
        self.read_body = read_body
        self.known = known
        self.body_limit = body_limit
        self.workers = RateLimiter(trust.requests_per_second, trust.request_burst)
        self.chunks = RateLimiter(trust.chunk_requests_per_second, trust.chunk_request_burst)
        self.relayed = RateLimiter(trust.relay_requests_per_second, trust.relay_request_burst)
        self.addresses = RateLimiter(trust.requests_per_second, trust.request_burst)
        hourly = trust.registrations_per_address_per_hour
        self.registrations = RateLimiter(hourly / 3600.0, hourly)
        self.limiters = {
            "workers": self.workers,
            "chunks": self.chunks,
            "relayed": self.relayed,
            "addresses": self.addresses,
            "registrations": self.registrations,
        }
        with context.store.transaction() as db:  # a restart must not hand out fresh bursts
            for name, limiter in self.limiters.items():
                limiter.restore(load_buckets(db, name))
        self.replay = ReplayGuard(trust.max_clock_skew_seconds, self._remember)
        self._last_recorded: dict[str, float] = {}
        self.suppressed: Counter[str] = Counter()
        """Anonymous refusals not written as events (at most one a second per reason is)."""

    def _remember(self, identity: str, nonce: str, expires: float) -> bool:
        with self.context.store.transaction() as db:
            return remember_nonce(db, identity, nonce, expires)

    def save_buckets(self) -> None:
        """Write the rate-limit buckets to the store (the sweeper does it every few seconds)."""
        with self.context.store.transaction() as db:
            for name, limiter in self.limiters.items():
                save_buckets(db, name, limiter.snapshot(), limiter.rate, limiter.burst)

    # ------------------------------------------------------------------ helpers

    async def _reject(
        self,
        status: int,
        detail: str,
        reason: Reason | str,
        worker_id: str | None,
        headers: dict[str, str] | None = None,
    ) -> ApiError:
        """A refusal that is no strike. Without a worker (a bad token from anywhere), one `rejected`
        event a second per reason at most, the rest counted in `suppressed`: many addresses sending
        junk must not become as many fsynced rows. A worker's refusals are bounded by its rate limit."""
        if worker_id is None:
            now = time.monotonic()
            if now - self._last_recorded.get(f"anonymous:{reason}", -1.0) < 1.0:
                self.suppressed[reason] += 1
                return ApiError(status, detail, reason, headers)
            self._last_recorded[f"anonymous:{reason}"] = now
        await run_in_threadpool(reputation.record_rejection, self.context, worker_id, reason)
        return ApiError(status, detail, reason, headers)

    async def _throttled(self, key: str, worker_id: str | None, rate: float | None = None) -> ApiError:
        now = time.monotonic()
        if now - self._last_recorded.get(key, -1.0) >= 1.0:
            self._last_recorded[key] = now
            await run_in_threadpool(reputation.record_rejection, self.context, worker_id, Reason.RATE_LIMITED)
        detail = (
            f"too many requests (limit {rate or self.trust.requests_per_second:g}/s); slow down and retry"
        )
        headers = {"Retry-After": "1"}
        if key.startswith("addr:"):
            # An address out of its allowance (spent on junk signatures, replays, unknown tokens,
            # or an honest fleet's registrations behind one NAT) is answered a second late, after
            # its request released its part of the budget (http/budget.py), and told to retry at
            # once: an honest client waits the second it waited before, and a sender that ignores
            # Retry-After gets one answer a second per connection.
            headers = {"Retry-After": "0", TARPIT_HEADER: "1"}
        return ApiError(429, detail, Reason.RATE_LIMITED, headers)

    def _lookup(self, token: str) -> tuple[str | None, str | None, str | None]:
        """(worker_id, public_key, quarantine reason) of the worker holding `token`."""
        with self.context.store.transaction() as db:
            row = db.execute(
                "SELECT w.worker_id, k.public_key FROM workers w"
                " LEFT JOIN worker_keys k ON k.worker_id = w.worker_id WHERE w.token_sha256 = ?",
                (hash_token(token),),
            ).fetchone()
            if row is None:
                return None, None, None
            return row["worker_id"], row["public_key"], reputation.quarantined(db, row["worker_id"])

    # ------------------------------------------------------------------ admission

    async def enrollment(self, request: Request, authorization: str | None, enroll_token: str) -> str:
        """Admit a registration; returns the caller's address."""
        address = request.client.host if request.client else ""
        now = self.context.clock()
        if self.trust.registration == "permissioned":
            if self.addresses.exhausted(address, now):
                raise await self._throttled(f"addr:{address}", None)
            if not authorization or not same_token(bearer_token(authorization), enroll_token):
                self.addresses.allow(address, now)
                self.known.auth_failed(address)
                detail = "invalid enrollment token; use the one in the coordinator's tokens.json"
                raise await self._reject(401, detail, Reason.AUTH, None)
        elif not self.registrations.allow(address, now):
            raise await self._throttled(f"register:{address}", None)
        return address

    async def anonymous(self, request: Request) -> None:
        """Admit an unauthenticated request that costs little (a registration challenge)."""
        address = request.client.host if request.client else ""
        if not self.addresses.allow(address, self.context.clock()):
            raise await self._throttled(f"addr:{address}", None)

    async def worker(self, request: Request, authorization: str | None) -> str:
        """The id of the worker making `request`, or an ApiError saying why it may not."""
        now = self.context.clock()
        address = request.client.host if request.client else ""
        if self.addresses.exhausted(address, now):
            raise await self._throttled(f"addr:{address}", None)
        token = bearer_token(authorization)
        worker_id, public_key, quarantine = await run_in_threadpool(self._lookup, token)
        if worker_id is None:
            self.addresses.allow(address, now)
            self.known.auth_failed(address)  # past its budget, the address is refused before the lookup
            detail = "invalid worker token; register with POST /v1/workers/register"
            raise await self._reject(401, detail, Reason.AUTH, None)
        if quarantine is not None:
            self.known.discard(hash_token(token))
            raise ApiError(403, f"worker {worker_id} is quarantined: {quarantine}", Reason.QUARANTINED)
        kind = "worker"
        if request.method == "GET" and request.url.path.startswith(CHUNK_PATH):
            kind = "chunks"
        elif request.url.path.startswith(RELAY_PATH):
            kind = "relayed"
        limiter = {"worker": self.workers, "chunks": self.chunks, "relayed": self.relayed}[kind]
        key = f"{kind}:{worker_id}"
        if limiter.exhausted(worker_id, now):
            raise await self._throttled(key, worker_id, limiter.rate)
        if self.trust.signed_requests:
            try:
                await self._check_signature(request, worker_id, public_key, now)
            except ApiError:
                # Junk signatures and replays are charged to the sender's address, never to the
                # worker: anyone holding its token or a captured request can send them. Concurrent
                # ones all passed the check above: past the allowance they are answered as throttled
                # (late), so an address gets its allowance of refusals a second, not that many per
                # connection.
                if not self.addresses.allow(address, now):
                    raise await self._throttled(f"addr:{address}", None) from None
                raise
        if not limiter.allow(worker_id, now):
            raise await self._throttled(key, worker_id, limiter.rate)
        self.known.add(hash_token(token))  # it may use the budget kept for known clients
        return worker_id

    async def _check_signature(
        self, request: Request, worker_id: str, public_key: str | None, now: float
    ) -> None:
        timestamp = request.headers.get(TIMESTAMP_HEADER)
        nonce = request.headers.get(NONCE_HEADER)
        signature = request.headers.get(SIGNATURE_HEADER)
        if public_key is None or not (timestamp and nonce and signature):
            detail = (
                f"unsigned request: send {TIMESTAMP_HEADER}, {NONCE_HEADER} and {SIGNATURE_HEADER} made"
                " with the key you registered (decentrl workers do this; register again with public_key)"
            )
            raise await self._reject(401, detail, Reason.BAD_SIGNATURE, worker_id)
        limit = await self.body_limit(request, worker_id)  # may refuse (429) before a byte is read
        try:
            body = await self.read_body(request, limit)
        except ApiError as error:
            # Nothing signed was read: anyone holding the token could have sent it, so the refusal
            # is recorded as an outsider's (one event a second at most), never against the worker.
            # An oversized body is answered a second late: a sleeping coroutine costs nothing, and
            # a sender that waits for its answers gets one a second per request slot of its token.
            if error.status == 413:
                await asyncio.sleep(OVERSIZED_ANSWER_DELAY)
            raise await self._reject(error.status, error.detail, error.reason, None) from None
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        message = signed_message(request.method, path, timestamp, nonce, body)
        if not signature_valid(public_key, signature, message):
            detail = "request signature does not verify under the worker's registered key"
            raise await self._reject(401, detail, Reason.BAD_SIGNATURE, worker_id)
        # A replayed GET changes nothing: memory is enough for one process. Replicas share the store,
        # and a request captured on its way to one must not be accepted by another.
        # Relayed steps are checked again end to end by their holder (the driver signs for it) and
        # live in this process's memory alone: an fsync per decode step would be the relay's cost.
        relayed = request.url.path.startswith(RELAY_PATH)
        durable = (request.method != "GET" or self.context.store.shared) and not relayed
        refusal = await run_in_threadpool(self.replay.check, worker_id, timestamp, nonce, now, durable)
        if refusal is not None:
            headers = {SERVER_TIME_HEADER: f"{now:.3f}"} if refusal.reason == Reason.CLOCK_SKEW else None
            raise await self._reject(401, refusal.detail, Reason(refusal.reason), worker_id, headers)
