"""A listening socket for the HTTP servers of decentrl (the coordinator, `decentrl serve`): bound
before anything is announced, so a port of 0 (any free one) is known once the socket accepts; and
the stop signals of such a server, caught before it is announced."""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from decentrl.config import ConfigError

if TYPE_CHECKING:
    import uvicorn


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host:port` whose connections send without Nagle's delay.

    asyncio turns Nagle off on each accepted connection only when the listening socket says
    IPPROTO_TCP (a plain `socket(AF_INET, SOCK_STREAM)` says 0). With it on, an answer on a
    kept-alive connection (uvicorn sends its head and its body apart) held its body until the
    client's delayed ACK: about 40 ms added to every request after a connection's first few."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it (Linux)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        reason = error.strerror or str(error)
        raise ConfigError(
            f"cannot listen on {host}:{port} ({reason}); stop what uses it, or pick another port"
            " (--port, coordinator.port) or 0 for any free one"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


@contextmanager
def absorb_reraised_signals(server: uvicorn.Server) -> Iterator[None]:
    """Make a SIGTERM/SIGINT shutdown end `serve()` normally (exit status 0).

    uvicorn handles the signal (graceful shutdown), then restores the handlers it found and raises
    the signal again; with the default handlers that would kill the process after a clean stop.
    A signal that comes before uvicorn installs its own handlers (the run is announced first, so a
    launcher may stop the coordinator that early) must not be lost either: it asks `server` to exit,
    which uvicorn honours as soon as it has started.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def early_exit(signum: int, frame: object) -> None:
        server.should_exit = True

    previous = {sig: signal.signal(sig, early_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
