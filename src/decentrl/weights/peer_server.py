"""A worker's chunk server: `GET /chunks/{sha256}` from its verified chunk store, for other workers,
and `GET /chunks` listing the chunks it holds (BitTorrent's bitfield, as text: one name a line).

Plain `http.server` in a daemon thread (one thread per connection): chunks are files, requests are
few and large, and the worker's event-free main loop stays untouched. Unknown chunks are 404, so a
requester moves on to its next source after one round trip. An optional token bucket caps this
worker's upload rate over all its connections.

What it serves, to whoever asks, is what the coordinator serves to every enrolled worker: chunks
of published versions this worker fetched and verified, named by their hash (a requester must know
a chunk's name to get it), and the list of those names. Nothing else on the machine is reachable
through it. A run whose weights must stay inside its fleet binds `worker.peer_host` to the fleet's
private network (listed in `weights.peer_networks`) or leaves `serve_peers` off (docs/security.md).
Each connection has `SOCKET_TIMEOUT_SECONDS` for every read and write and at most
`MAX_CONNECTIONS` are served at once, so idle or slow clients cannot pin its threads.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from decentrl.weights.bandwidth import TokenBucket
from decentrl.weights.chunks import ChunkStore

HEX = frozenset("0123456789abcdef")
SOCKET_TIMEOUT_SECONDS = 10.0
MAX_CONNECTIONS = 16


class BoundedServer(ThreadingHTTPServer):
    """At most `MAX_CONNECTIONS` connections at once; more are closed unanswered."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]):
        super().__init__(address, handler)
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request, client_address) -> None:  # noqa: ANN001 - socketserver's
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:  # noqa: ANN001
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class PeerServer:
    def __init__(
        self, store: ChunkStore, host: str = "127.0.0.1", port: int = 0, bytes_per_second: float | None = None
    ):
        self.store = store
        self.bucket = TokenBucket(bytes_per_second) if bytes_per_second else None
        self.served_bytes = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = SOCKET_TIMEOUT_SECONDS  # each read and write of the connection's socket
            # A fetcher keeps its connection: the head and the body go in two sends, and a small
            # body (a 404, the list of held chunks) would wait for its delayed ACK (40 ms).
            disable_nagle_algorithm = True

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                server.handle(self)

        self.httpd = BoundedServer((host, port), Handler)
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.1,), daemon=True)

    def start(self) -> PeerServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def chunk_bytes(self, digest: str) -> bytes | None:
        """What this server sends for a chunk (a hook: adversarial tests serve garbage here)."""
        return self.store.get(digest) if self.store.has(digest) else None

    def held_digests(self) -> set[str]:
        """What this server says it holds (a hook too)."""
        return self.store.digests()

    def handle(self, request: BaseHTTPRequestHandler) -> None:
        name = request.path.removeprefix("/chunks/")
        data = None
        if request.path == "/chunks":
            data = "\n".join(sorted(self.held_digests())).encode()
        elif request.path.startswith("/chunks/") and len(name) == 64 and set(name) <= HEX:
            data = self.chunk_bytes(name)
        if data is None:
            request.send_response(404)
            request.send_header("Content-Length", "0")
            request.end_headers()
            return
        request.send_response(200)
        request.send_header("Content-Type", "application/octet-stream")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        pieces = self.bucket.pieces(data) if self.bucket else [memoryview(data)]
        for piece in pieces:
            if self.bucket:
                time.sleep(self.bucket.reserve(len(piece)))
            request.wfile.write(piece)
        self.served_bytes += len(data)
