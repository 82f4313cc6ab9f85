"""Hostile chunk servers: peers that claim every chunk, then trickle or flood instead of serving it
(`tests/integration/test_peer_attacks.py` and `tests/adversarial/test_peers.py` share them).

Each is a plain socket server on a loopback address of its own (127.0.0.0/8 reaches this machine at
every address, so a swarm of peers "on different hosts" fits on one machine). Every loop is bounded
by a byte count or by `stop()`.
"""

from __future__ import annotations

import socket
import socketserver
import threading
from contextlib import suppress
from enum import Enum

PIECE = 64 * 1024


class Misbehaviour(Enum):
    TRICKLE = "trickle"
    """One byte every `interval` seconds, with no length announced, until the requester gives up."""
    FLOOD = "flood"
    """`flood_bytes` of junk, as fast as the requester reads (far more than any chunk)."""


class HostilePeer:
    def __init__(
        self,
        behaviour: Misbehaviour,
        digests: set[str],
        host: str = "127.0.0.1",
        interval: float = 0.5,
        flood_bytes: int = 200 << 20,
    ) -> None:
        self.behaviour, self.digests = behaviour, digests
        self.interval, self.flood_bytes = interval, flood_bytes
        self.sent = 0
        """Body bytes the requesters' sockets accepted (the kernel's buffers included)."""
        self.requests = 0
        self._stop = threading.Event()
        peer = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                with suppress(OSError):
                    peer._answer(self.rfile, self.connection)

        self.server = socketserver.ThreadingTCPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.1,), daemon=True).start()

    def _answer(self, rfile, connection: socket.socket) -> None:  # noqa: ANN001 - a socket file
        path = rfile.readline().split()[1].decode()
        while rfile.readline() not in (b"\r\n", b"\n", b""):
            pass
        if path == "/chunks":  # claims everything, so that requesters come for it
            listing = "\n".join(sorted(self.digests)).encode()
            head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(listing)}\r\nConnection: close\r\n\r\n"
            connection.sendall(head.encode() + listing)
            return
        self.requests += 1
        connection.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
        if self.behaviour is Misbehaviour.TRICKLE:
            while not self._stop.wait(self.interval):
                connection.sendall(b"x")
                self.sent += 1
            return
        junk = b"x" * PIECE
        while self.sent < self.flood_bytes and not self._stop.is_set():
            connection.sendall(junk)
            self.sent += len(junk)

    def stop(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
