"""`decentrl bench pipeline`'s parts: the delaying TCP proxy adds the round trip it is set to (and
a handshake per new connection), keeps a jittered stream in order and counts its bytes; the
reading of the grid turns times per RTT into round trips per token."""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from benchmarks.pipeline.delay_proxy import DelayProxy
from benchmarks.pipeline.main import reading

RTT_S = 0.1
# Sleeping is never early, so a round trip is at least the delay; scheduling on a loaded 2-core
# machine may add to it, never take from it.
SLACK_S = 0.08 * max(1.0, os.getloadavg()[0] / 2)


class Echo(BaseHTTPRequestHandler):
    """Answers a POST with its body, on a kept connection, as the stage server does."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield "127.0.0.1", server.server_address[1]
    server.shutdown()
    server.server_close()


def round_trip(client: httpx.Client, url: str, body: bytes) -> float:
    started = time.perf_counter()
    answer = client.post(url, content=body)
    assert answer.content == body
    return time.perf_counter() - started


def test_a_request_pays_the_rtt_and_a_new_connection_its_handshake(echo: tuple[str, int]) -> None:
    proxy = DelayProxy(*echo, rtt_s=RTT_S).start()
    try:
        with httpx.Client() as client:
            first = round_trip(client, proxy.url, b"x" * 100)  # connect: SYN, SYN-ACK, then the request
            kept = [round_trip(client, proxy.url, b"y" * 100) for _ in range(3)]
            large = round_trip(client, proxy.url, os.urandom(4 << 20))  # bandwidth is not capped
        traffic = proxy.reset()
    finally:
        proxy.close()
    assert 2 * RTT_S <= first < 2 * RTT_S + SLACK_S
    assert all(RTT_S <= seconds < RTT_S + SLACK_S for seconds in kept), kept
    assert RTT_S <= large < RTT_S + 4 * SLACK_S
    assert traffic.connections == 1
    assert traffic.bytes_up > (4 << 20) + 400 and traffic.bytes_down > (4 << 20) + 400


def test_no_delay_relays_at_once_and_rtt_changes_between_requests(echo: tuple[str, int]) -> None:
    proxy = DelayProxy(*echo).start()
    try:
        with httpx.Client() as client:
            quick = round_trip(client, proxy.url, b"z")
            proxy.rtt_s = RTT_S
            slow = round_trip(client, proxy.url, b"z")
    finally:
        proxy.close()
    assert quick < SLACK_S
    assert RTT_S <= slow < RTT_S + SLACK_S


def test_jitter_keeps_the_stream_in_order(echo: tuple[str, int]) -> None:
    """Raw TCP: many small writes, each delayed by a random amount, arrive whole and in order."""
    proxy = DelayProxy(*echo, rtt_s=0.02, jitter_s=0.01, seed=1).start()
    body = bytes(random.Random(0).randrange(256) for _ in range(20_000))
    head = f"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            data = head + body
            for start in range(0, len(data), 500):
                sock.sendall(data[start : start + 500])
                time.sleep(0.0005)
            received = b""
            while not received.endswith(body):
                chunk = sock.recv(1 << 16)
                assert chunk, "the proxy closed before the whole answer came back"
                received += chunk
    finally:
        proxy.close()
    assert received.split(b"\r\n\r\n", 1)[1] == body


def test_the_reading_turns_times_per_rtt_into_round_trips_per_token() -> None:
    """10 tokens, 2 stages (1 hop): 20 ms a token with no delay, 2 RTTs a token added per RTT."""
    cells = [
        {
            "stages": 2,
            "server": "connection per step",
            "batch": 8,
            "rtt_ms": rtt,
            "seconds": 0.2 + 10 * 2 * rtt / 1000,
        }
        for rtt in (0, 100, 300)
    ]
    cells += [  # 3 stages (2 hops), kept connections: one RTT per hop per token
        {"stages": 3, "server": "as shipped", "batch": 1, "rtt_ms": rtt, "seconds": 0.1 + 10 * 2 * rtt / 1000}
        for rtt in (0, 20)
    ]
    (three, two) = sorted(reading(cells, new_tokens=10), key=lambda row: -row["stages"])
    assert two == {
        "stages": 2,
        "server": "connection per step",
        "batch": 8,
        "ms_per_token_at_first_rtt": 20.0,
        "added_rtts_per_token_per_hop": 2.0,
    }
    assert three["ms_per_token_at_first_rtt"] == 10.0 and three["added_rtts_per_token_per_hop"] == 1.0
