"""What `decentrl serve` checks before a request reaches a route: its bearer token and its size.

A pure ASGI layer, so both run before FastAPI reads or parses a byte of the body: a request
without the token is answered 401 from its headers alone, and a body over the limit is answered
413 from its `Content-Length`, or, when it is sent without one (chunked), as soon as the bytes
received pass the limit. Nothing unauthenticated is read, and nothing oversized is kept, parsed or
tokenised.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BODY_BYTES = 1 << 20
"""1 MiB: a prompt of 8,192 tokens as text or as ids, or a long chat, is well under it."""


async def _refuse(send: Send, status: int, detail: str, headers: list[tuple[bytes, bytes]] = []) -> None:  # noqa: B006 - never mutated
    body = json.dumps({"error": {"message": detail, "code": status}}).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def _bearer(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


class ServeGuard:
    """Wraps the app: a request needs `Authorization: Bearer <token>` and at most `max_body_bytes`."""

    def __init__(self, app: App, token: str, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        assert token, "decentrl serve always has a token"
        self.app, self.token, self.max_body_bytes = app, token.encode(), max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not hmac.compare_digest(_bearer(scope).encode(), self.token):
            detail = (
                "decentrl serve needs its token: send `Authorization: Bearer <token>` (the OpenAI API key)"
            )
            return await _refuse(send, 401, detail, [(b"www-authenticate", b"Bearer")])
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_body_bytes:
            return await _refuse(send, 413, self._too_large(declared.decode("latin-1")))
        body = await self._read(receive)
        if body is None:
            return await _refuse(send, 413, self._too_large(f"more than {self.max_body_bytes}"))
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The whole body, or None as soon as more than `max_body_bytes` arrived (a chunked body
        declares no length)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)  # the client left: the route will see an empty body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self, size: str) -> str:
        return f"request body of {size} bytes exceeds the limit of {self.max_body_bytes} bytes"
