"""Connection admission: the coordinator's defence against idle, slow and hoarded sockets.

uvicorn by itself never closes a connection that has not finished sending its request head
(its keep-alive timer starts only after a first response) and answers 503 to *everybody* once
`limit_concurrency` connections exist, so a single client holding ~1,000 idle sockets stops the
service. `GuardedProtocol` is uvicorn's h11 protocol with four additions, all decided on the
event loop without touching the store:

- a header deadline: a connection must deliver a complete request head within
  `service.header_timeout_seconds` of its first byte (or of being opened), else it is closed;
- an idle deadline between requests (`service.idle_timeout_seconds`, uvicorn's keep-alive timer);
- at most `service.max_connections_per_address` open connections per client address (more are
  closed at once, before a byte is read);
- at most `service.max_connections` in all: past it, the connection that has waited longest
  without a request in progress is closed to make room, so honest clients, which send their
  request as soon as they connect, keep getting through while idle sockets are shed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from decentrl.config import ServiceConfig

log = logging.getLogger(__name__)


@dataclass
class ConnectionBook:
    """Open connections of one server, by address; counts what it refused (for `/v1/stats`)."""

    config: ServiceConfig
    per_address: Counter[str] = field(default_factory=Counter)
    waiting: dict[GuardedProtocol, float] = field(default_factory=dict)
    """Connections without a request in progress, with the time they started waiting."""
    open: int = 0
    refused_per_address: int = 0
    evicted: int = 0
    header_timeouts: int = 0

    def admit(self, connection: GuardedProtocol, address: str) -> bool:
        capped = address not in self.config.trusted_proxies  # a proxy caps its own clients
        if capped and self.per_address[address] >= self.config.max_connections_per_address:
            self.refused_per_address += 1
            return False
        if self.open >= self.config.max_connections and self.waiting:
            oldest = min(self.waiting, key=self.waiting.__getitem__)
            self.evicted += 1
            oldest.drop()
        self.per_address[address] += 1
        self.open += 1
        return True

    def release(self, address: str) -> None:
        self.per_address[address] -= 1
        if self.per_address[address] <= 0:
            del self.per_address[address]
        self.open -= 1

    def stats(self) -> dict:
        return {
            "open": self.open,
            "addresses": len(self.per_address),
            "refused_per_address": self.refused_per_address,
            "evicted": self.evicted,
            "header_timeouts": self.header_timeouts,
        }


class GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol with header/idle deadlines and the per-address and global caps."""

    book: ConnectionBook  # set on the subclass that `guarded_protocol` makes for one server

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._address = self.client[0] if self.client else ""
        self._header_timer: asyncio.TimerHandle | None = None
        self._admitted = self.book.admit(self, self._address)
        if not self._admitted:
            transport.abort()  # refused before reading a byte: costs the server nothing more
            return
        self._await_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        if getattr(self, "_admitted", False):
            self._admitted = False
            self.book.waiting.pop(self, None)
            self.book.release(self._address)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._admitted or self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE:  # still (or again) waiting for a complete head
            if self._header_timer is None:
                self._await_request()
        else:  # a request is in progress: the app's body timeout and the handler take over
            self._stop_header_timer()
            self.book.waiting.pop(self, None)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # arms uvicorn's keep-alive (idle) timer
        if self._admitted and not self.transport.is_closing():
            self.book.waiting[self] = time.monotonic()

    def _await_request(self) -> None:
        self.book.waiting.setdefault(self, time.monotonic())
        self._header_timer = self.loop.call_later(self.book.config.header_timeout_seconds, self._too_slow)

    def _stop_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _too_slow(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.book.header_timeouts += 1
            self.drop()

    def drop(self) -> None:
        """Close without a response: the peer sent no complete request to answer."""
        self._stop_header_timer()
        self.book.waiting.pop(self, None)
        self.transport.abort()


def guarded_protocol(config: ServiceConfig) -> tuple[type[GuardedProtocol], ConnectionBook]:
    """A protocol class for one server (pass it as uvicorn's `http`) and the book it keeps."""
    book = ConnectionBook(config)
    return type("CoordinatorProtocol", (GuardedProtocol,), {"book": book}), book
