"""A user-space TCP proxy that adds network latency: what `tc qdisc ... netem delay` would do, on
a kernel without netem and without root.

Every connection accepted on the proxy's loopback port is relayed to the upstream address, and
every chunk of bytes read in either direction is written out `rtt_s / 2` later (plus a uniform
draw in ±`jitter_s`), so a request and its answer take one added round trip. Reading goes on while
delayed chunks wait, so the delay does not cap the bandwidth: a large body takes one delay, not one
per chunk. A chunk is never written before the one ahead of it (a TCP stream keeps its order, so
jitter only ever stretches the gaps).

A new connection also pays its TCP handshake, which the kernel completes locally at once: the first
bytes a client sends reach upstream no sooner than 1.5 RTT after it connected (SYN, SYN-ACK, then
the data's own half trip), as on a real link. A server that closes its connection after each
answer therefore costs two round trips per request here, as it would across the internet.

The proxy runs its own asyncio loop in a daemon thread; `rtt_s` and `jitter_s` may be changed
between requests. It counts the bytes relayed each way and the connections accepted.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

CHUNK_BYTES = 1 << 16


@dataclass
class Traffic:
    """What the proxy relayed since it started (or since `reset`)."""

    bytes_up: int = 0
    """Client to upstream."""
    bytes_down: int = 0
    """Upstream to client."""
    connections: int = 0


class DelayProxy:
    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        rtt_s: float = 0.0,
        jitter_s: float = 0.0,
        seed: int = 0,
        handshake: bool = True,
    ):
        assert rtt_s >= 0 and jitter_s >= 0
        self.upstream = (upstream_host, upstream_port)
        self.rtt_s = rtt_s
        self.jitter_s = jitter_s
        self.handshake = handshake
        """Hold a new connection's first bytes until its TCP handshake would be done (1 RTT)."""
        self.traffic = Traffic()
        self.random = random.Random(seed)
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._stopping = asyncio.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="delay-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        self._thread.start()
        self._ready.wait()
        return self

    def reset(self) -> Traffic:
        """The traffic so far; the counters restart from zero."""
        traffic, self.traffic = self.traffic, Traffic()
        return traffic

    def close(self) -> None:
        """Stop accepting, end every relayed connection, and stop the loop's thread."""
        self.loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(timeout=5)
        self.loop.close()

    def one_way_delay(self) -> float:
        jitter = self.random.uniform(-self.jitter_s, self.jitter_s) if self.jitter_s else 0.0
        return max(0.0, self.rtt_s / 2 + jitter)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        await self._stopping.wait()
        server.close()
        relays = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in relays:
            task.cancel()
        await asyncio.gather(*relays, return_exceptions=True)

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        accepted = time.monotonic()
        self.traffic.connections += 1
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_writer.close()
            return
        # The handshake takes a round trip before the client's first bytes leave it.
        not_before = accepted + self.rtt_s if self.handshake else accepted

        def reset() -> None:  # both ends see the connection break, as after a lost link
            for writer in (client_writer, upstream_writer):
                writer.transport.abort()

        relays = asyncio.gather(
            self._pump(client_reader, upstream_writer, "up", not_before, reset),
            self._pump(upstream_reader, client_writer, "down", accepted, reset),
            return_exceptions=True,
        )
        try:
            await relays
        except asyncio.CancelledError:
            # `close` ends open connections by cancelling; the connection's task must still end
            # normally, as asyncio.streams reads its outcome (a cancelled one logs an error there).
            relays.cancel()

    def due(self, direction: str, size: int, now: float, not_before: float, last_due: float) -> float | None:
        """When a chunk of `size` bytes read at `now` reaches the other side: `one_way_delay()`
        later (or after `not_before`, when the link would only then carry it), never before the
        chunk ahead of it. None: the connection breaks instead (a subclass's loss model)."""
        return max(last_due, max(now, not_before) + self.one_way_delay())

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        direction: str,
        not_before: float,
        reset: Callable[[], None],
    ) -> None:
        """Relay `reader` to `writer`, each chunk when `due` says (`reset` both ends when it says
        the connection breaks)."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:  # end of stream, delayed like the bytes before it
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()

        delivery = asyncio.ensure_future(deliver())
        last_due = 0.0
        try:
            while True:
                data = await reader.read(CHUNK_BYTES)
                if direction == "up":
                    self.traffic.bytes_up += len(data)
                else:
                    self.traffic.bytes_down += len(data)
                due = self.due(direction, len(data), time.monotonic(), not_before, last_due)
                if due is None:
                    reset()
                    break
                last_due = due
                queue.put_nowait((last_due, data))
                if not data:
                    break
            if due is None:
                delivery.cancel()
            else:
                await delivery
        except (ConnectionError, OSError):
            delivery.cancel()
        finally:
            writer.close()
