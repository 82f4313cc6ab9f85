"""Answers on a kept-alive connection are not held back by Nagle's algorithm.

uvicorn and http.server send an answer's head and its body in two writes. With Nagle on, the
second waits until the first is acknowledged, and a client delays its ACK (40 ms on Linux): every
request on a kept-alive connection after its first few took 40 ms more, whatever it did. That was
the coordinator (its listening socket said protocol 0, so asyncio never turned Nagle off on its
connections) and the peers' chunk servers. The delay is deterministic: with Nagle on, not one of
a connection's later requests answers in under 40 ms; off, they take a few milliseconds.
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time

import pytest
import uvicorn

from decentrl.listen import bind
from decentrl.weights.chunks import ChunkStore
from decentrl.weights.peer_server import PeerServer

pytestmark = pytest.mark.timeout(60)

REQUESTS = 8
FAST_S = 0.035
"""Under the 40 ms a delayed ACK costs: the quickest of a connection's later requests."""


def kept_alive_latencies(host: str, port: int, path: str) -> list[float]:
    """Seconds from sending each of `REQUESTS` GETs on one connection to the end of its answer
    (the client sends without delay itself: only the server can hold an answer back)."""
    latencies = []
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
        for _ in range(REQUESTS):
            started = time.perf_counter()
            sock.sendall(request)
            received = b""
            while True:
                chunk = sock.recv(65536)
                assert chunk, "the server closed the connection"
                received += chunk
                head, separator, body = received.partition(b"\r\n\r\n")
                if not separator:
                    continue
                lines = head.decode().lower().split("\r\n")
                length = int(next(line.split(":")[1] for line in lines if line.startswith("content-length")))
                if len(body) >= length:
                    break
            latencies.append(time.perf_counter() - started)
    return latencies


async def two_sends(scope, receive, send) -> None:
    """An ASGI app answering as the coordinator's routes do: the head, then the body."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body = b'{"status": "ok"}'
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def test_the_coordinators_socket_answers_kept_alive_requests_without_nagle_delay():
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(two_sends, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        latencies = kept_alive_latencies("127.0.0.1", sock.getsockname()[1], "/v1/health")
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
    assert min(latencies[1:]) < FAST_S, [round(s, 4) for s in latencies]
    assert sock.proto == socket.IPPROTO_TCP  # what asyncio checks before turning Nagle off


def test_a_peer_answers_kept_alive_requests_without_nagle_delay(tmp_path):
    store = ChunkStore(tmp_path / "chunks")
    data = b"a chunk"
    digest = hashlib.sha256(data).hexdigest()
    store.put(digest, data)
    server = PeerServer(store).start()
    try:
        port = int(server.url.rsplit(":", 1)[1])
        latencies = kept_alive_latencies("127.0.0.1", port, f"/chunks/{digest}")
    finally:
        server.stop()
    assert min(latencies[1:]) < FAST_S, [round(s, 4) for s in latencies]
