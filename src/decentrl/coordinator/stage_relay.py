"""The relay: stage steps for holders that accept no connections (behind NAT or a firewall).

A holder that announced no address, or whose address the coordinator could not connect to
(`stage_routing.StageHolders.announce`), is routed as *relayed*. Its driver posts each step to
`POST /v1/relay/{holder}/{lease}/stage/{step|close}` here, exactly the body and signature it
would send the holder directly (`stage_wire.relay_path` is the path it signs). The holder keeps
one outbound request open, `POST /v1/relay/exchange`: its body answers the previous request it
was handed, and the response hands it the next one (or 204 after `wait` seconds), with the
driver's signature headers and the path the driver signed. So a relayed step costs the driver's
round trip to the coordinator plus the holder's, and the holder opens no port.

The relay is a courier, not a party: the holder checks the driver's signature over the relay path
(which names the holder and the lease), its timestamp, nonce and step order, as on a direct
connection, and its signed commitments cover every byte it answered, so the coordinator can
neither forge nor alter a step unseen. What the relay checks is what keeps it cheap to run: a
driver may only post to a holder on the route of its own open lease, bodies are bounded, each
holder has a bounded queue, and a request nobody answers in `ANSWER_SECONDS` is a 504. Requests
and holders live in this process's memory: with several coordinator replicas, holders and drivers
must reach the relay through the same one (docs/pipeline.md).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request, Response
from starlette.concurrency import run_in_threadpool

from decentrl.coordinator.context import Context
from decentrl.coordinator.http.body import read_body
from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.protocol import API_PREFIX
from decentrl.stage_wire import (
    RELAY_ACTIONS,
    RELAY_PATH_HEADER,
    RELAY_REQUEST_HEADER,
    RELAY_STATUS_HEADER,
    relay_path,
)
from decentrl.trust.identity import SIGNED_HEADERS

EXCHANGE_PATH = f"{API_PREFIX}/relay/exchange"
MAX_QUEUED = 16
"""Requests waiting for one holder (each up to `coordinator.relay_max_body_bytes`); past it a driver is answered 503 (the holder is saturated)."""
ANSWER_SECONDS = 30.0
"""A relayed request not answered within this is a 504 (the driver's own hop timeout is 30 s)."""
MAX_WAIT_SECONDS = 25.0
"""Longest a holder's exchange waits for a request (under clients' and proxies' read timeouts)."""
DISCONNECT_CHECK_SECONDS = 0.25
"""How often a waiting exchange looks whether its holder hung up."""
CONNECTED_SECONDS = MAX_WAIT_SECONDS + 10.0
"""A holder with no exchange open or ended this recently is not connected: its drivers get 503."""


@dataclass
class Relayed:
    request_id: str
    holder_id: str
    path: str
    headers: dict[str, str]
    body: bytes
    answer: asyncio.Future[tuple[int, bytes]]


@dataclass
class Mailbox:
    """One holder's side of the relay."""

    queue: asyncio.Queue[Relayed] = field(default_factory=lambda: asyncio.Queue(MAX_QUEUED))
    seen: float = 0.0
    """When its last exchange arrived or ended (monotonic)."""
    open_exchanges: int = 0
    handed: dict[str, Relayed] = field(default_factory=dict)
    """Requests handed to the holder and not answered yet."""

    def lost(self) -> None:
        """The holder's last open exchange was cut (its process died, or its link did): what it
        was handed will not be answered, so its drivers hear it now, not at `ANSWER_SECONDS`."""
        while not self.queue.empty():
            self.handed[f"queued-{len(self.handed)}"] = self.queue.get_nowait()
        for relayed in self.handed.values():
            if not relayed.answer.done():
                relayed.answer.set_result((503, b"the stage holder's relay link dropped"))
        self.handed.clear()
        self.seen = 0.0  # not connected until it opens an exchange again


class Relay:
    def __init__(self, context: Context):
        self.context = context
        self.mailboxes: dict[str, Mailbox] = {}
        self.waiting: dict[str, Relayed] = {}
        """Requests handed to a holder and not answered yet, by id."""
        self.relayed = 0
        self.failed = 0
        self.bytes = 0

    def connected(self, holder_id: str) -> bool:
        box = self.mailboxes.get(holder_id)
        return box is not None and (box.open_exchanges > 0 or time.monotonic() - box.seen < CONNECTED_SECONDS)

    def check_route(self, driver_id: str, holder_id: str, lease_id: str) -> None:
        """`lease_id` is the driver's own open lease and its route runs through `holder_id`."""
        with self.context.store.transaction() as db:
            row = db.execute(
                "SELECT 1 FROM lease_routes r JOIN leases l ON l.lease_id = r.lease_id"
                " WHERE r.lease_id = ? AND r.worker_id = ? AND l.worker_id = ? AND l.state = 'open'",
                (lease_id, holder_id, driver_id),
            ).fetchone()
        if row is None:
            detail = f"no open lease {lease_id!r} of yours is routed through {holder_id!r}"
            raise ApiError(404, detail, Reason.UNKNOWN_LEASE)

    def is_holder(self, worker_id: str) -> bool:
        with self.context.store.transaction() as db:
            return (
                db.execute("SELECT 1 FROM stage_holders WHERE worker_id = ?", (worker_id,)).fetchone()
                is not None
            )

    async def forward(self, holder_id: str, path: str, headers: dict[str, str], body: bytes) -> Response:
        """Hand a driver's request to the holder and wait for its answer."""
        if not self.connected(holder_id):
            self.failed += 1
            detail = f"stage holder {holder_id!r} has no relay exchange open; it may have left"
            raise ApiError(503, detail, Reason.NOT_READY)
        box = self.mailboxes[holder_id]
        relayed = Relayed(
            secrets.token_hex(12), holder_id, path, headers, body, asyncio.get_running_loop().create_future()
        )
        try:
            box.queue.put_nowait(relayed)
        except asyncio.QueueFull:
            self.failed += 1
            raise ApiError(
                503, f"{MAX_QUEUED} requests wait for {holder_id!r}; retry", Reason.NOT_READY
            ) from None
        self.waiting[relayed.request_id] = relayed
        try:
            status, answer = await asyncio.wait_for(asyncio.shield(relayed.answer), ANSWER_SECONDS)
        except TimeoutError:
            self.failed += 1
            raise ApiError(
                504, f"stage holder {holder_id!r} did not answer in {ANSWER_SECONDS:g} s", Reason.NOT_READY
            ) from None
        finally:
            self.waiting.pop(relayed.request_id, None)
            box.handed.pop(relayed.request_id, None)
        self.relayed += 1
        self.bytes += len(body) + len(answer)
        return Response(content=answer, status_code=status, media_type="application/octet-stream")

    def take_answer(self, holder_id: str, request_id: str, status: int, body: bytes) -> None:
        """The holder's answer to a request it was handed (an unknown or foreign id is ignored:
        the driver gave up on it, or it is not this holder's to answer)."""
        relayed = self.waiting.get(request_id)
        if relayed is None or relayed.holder_id != holder_id or relayed.answer.done():
            return
        self.mailboxes[holder_id].handed.pop(request_id, None)
        relayed.answer.set_result((status, body))

    async def next_request(
        self, holder_id: str, wait: float, disconnected: Callable[[], Awaitable[bool]]
    ) -> Relayed | None:
        """The next request for `holder_id`, within `wait` s; None past it, or once the exchange's
        connection is gone (`disconnected`, checked every `DISCONNECT_CHECK_SECONDS`)."""
        box = self.mailboxes.setdefault(holder_id, Mailbox())
        box.open_exchanges += 1
        box.seen = time.monotonic()
        deadline = time.monotonic() + wait
        cut = False
        try:
            while time.monotonic() < deadline:
                try:
                    relayed = box.queue.get_nowait()
                except asyncio.QueueEmpty:
                    left = min(DISCONNECT_CHECK_SECONDS, deadline - time.monotonic())
                    try:
                        relayed = await asyncio.wait_for(box.queue.get(), max(0.0, left))
                    except TimeoutError:
                        cut = await disconnected()
                        if cut:
                            return None
                        continue
                if not relayed.answer.done():  # its driver has not given up on it
                    box.handed[relayed.request_id] = relayed
                    return relayed
            return None
        finally:
            box.open_exchanges -= 1
            box.seen = time.monotonic()
            if cut and box.open_exchanges == 0:
                box.lost()

    def stats(self) -> dict:
        return {
            "connected_holders": sum(self.connected(h) for h in self.mailboxes),
            "relayed_requests": self.relayed,
            "failed_requests": self.failed,
            "relayed_bytes": self.bytes,
        }


def add_relay_routes(app: FastAPI, context: Context, worker: Callable) -> Relay:
    relay = Relay(context)
    limit = context.config.relay_max_body_bytes

    @app.post(f"{API_PREFIX}/relay/{{holder_id}}/{{lease_id}}/stage/{{action}}")
    async def relay_step(
        holder_id: str, lease_id: str, action: str, request: Request, driver_id: str = Depends(worker)
    ) -> Response:
        path = request.scope["raw_path"].decode()
        if action not in RELAY_ACTIONS or path != relay_path(holder_id, lease_id, action):
            raise ApiError(404, f"no relay route {path}", Reason.UNKNOWN)
        await run_in_threadpool(relay.check_route, driver_id, holder_id, lease_id)
        body = await read_body(request, limit)
        headers = {name: request.headers.get(name, "") for name in SIGNED_HEADERS}
        return await relay.forward(holder_id, path, headers, body)

    @app.post(EXCHANGE_PATH)
    async def exchange(request: Request, wait: float = 20.0, holder_id: str = Depends(worker)) -> Response:
        body = await read_body(request, limit)
        if not await run_in_threadpool(relay.is_holder, holder_id):
            raise ApiError(
                403, "only a stage holder that announced itself keeps a relay exchange", Reason.STAGE
            )
        answered = request.headers.get(RELAY_REQUEST_HEADER)
        if answered:
            try:
                status = int(request.headers.get(RELAY_STATUS_HEADER, ""))
            except ValueError:
                raise ApiError(
                    422, f"an answer names its HTTP status in {RELAY_STATUS_HEADER}", Reason.SCHEMA
                ) from None
            relay.take_answer(holder_id, answered, status, body)
        relayed = await relay.next_request(
            holder_id, max(0.0, min(wait, MAX_WAIT_SECONDS)), request.is_disconnected
        )
        if relayed is None:
            return Response(status_code=204)
        headers = {
            RELAY_REQUEST_HEADER: relayed.request_id,
            RELAY_PATH_HEADER: relayed.path,
            **relayed.headers,
        }
        return Response(content=relayed.body, headers=headers, media_type="application/octet-stream")

    return relay
