"""`decentrl bench wan`'s emulated access link (benchmarks/wan/link.py) on real loopback sockets:
it delays, caps the bandwidth, stalls and breaks connections as told, and its token bucket's
arithmetic matches hand-computed values."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from benchmarks.wan.link import LinkSpec, WanLink


class Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(1 << 16):
            self.request.sendall(data)


@pytest.fixture
def echo() -> Iterator[int]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def exchange(sock: socket.socket, size: int) -> float:
    """Seconds from sending `size` bytes to having them all back."""
    started = time.monotonic()
    sock.sendall(b"x" * size)
    received = 0
    while received < size:
        data = sock.recv(1 << 16)
        if not data:
            raise ConnectionResetError("closed")
        received += len(data)
    return time.monotonic() - started


def link(port: int, **spec: float) -> WanLink:
    return WanLink("127.0.0.1", port, LinkSpec(**spec), seed=7).start()


def test_each_exchange_takes_one_added_round_trip(echo: int) -> None:
    proxy = link(echo, rtt_s=0.2)
    try:
        with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
            first = exchange(sock, 100)  # the handshake's round trip, then the exchange's
            second = exchange(sock, 100)
        assert first >= 0.4 - 0.01 and second >= 0.2 - 0.01, (first, second)
        assert second < 1.0
        assert proxy.traffic.bytes_up == proxy.traffic.bytes_down == 200
    finally:
        proxy.close()


def test_the_token_bucket_caps_the_bandwidth(echo: int) -> None:
    proxy = link(echo, bandwidth_bytes_per_s=100_000.0, burst_bytes=10_000)
    try:
        with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
            small = exchange(sock, 1_000)  # within the burst: no wait
            large = exchange(sock, 60_000)
        # up and down each hold 60 kB behind a bucket holding at most 10 kB: >= 0.5 s per direction,
        # the second starting as the first one's chunks arrive
        assert small < 0.1 and large >= 0.5, (small, large)
    finally:
        proxy.close()


def test_stalls_hold_a_chunk_and_drops_break_the_connection(echo: int) -> None:
    stalled = link(echo, stall_rate=0.999, stall_s=0.3)
    try:
        with socket.create_connection(("127.0.0.1", stalled.port)) as sock:
            assert exchange(sock, 100) >= 0.6 - 0.01  # held on the way up and again on the way down
        assert stalled.stalls == 2
    finally:
        stalled.close()
    lossy = link(echo, drop_rate=0.5)
    try:
        failed = 0
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", lossy.port)) as sock:
                sock.settimeout(5)
                try:
                    exchange(sock, 100)
                except (ConnectionError, OSError):
                    failed += 1
        assert 0 < failed < 20 and lossy.drops == failed, (failed, lossy.drops)
    finally:
        lossy.close()


def test_token_bucket_arithmetic() -> None:
    proxy = WanLink("127.0.0.1", 9, LinkSpec(bandwidth_bytes_per_s=1000.0, burst_bytes=100))
    assert proxy.transmitted("up", 100, 0.0) == 0.0  # the full bucket pays for it
    assert proxy.transmitted("up", 100, 0.0) == pytest.approx(0.1)  # refilled at 1000 B/s
    assert proxy.transmitted("up", 300, 0.05) == pytest.approx(0.4)  # queued behind the last one
    assert proxy.transmitted("down", 50, 0.0) == 0.0  # the other direction has its own bucket
    assert proxy.transmitted("up", 80, 1.0) == pytest.approx(1.0)  # idle 0.6 s: full again (capped at 100)
    assert proxy.transmitted("up", 80, 1.0) == pytest.approx(1.06)  # 20 left, 60 more to wait for
