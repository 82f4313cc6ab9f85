"""A listening socket for the HTTP servers of decentrl (the coordinator, `decentrl serve`): bound
before anything is announced, so a port of 0 (any free one) is known once the socket accepts."""

from __future__ import annotations

import socket

from decentrl.config import ConfigError


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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
