"""Reading a request body: bounded in size and time, read once, parsed strictly into a protocol model."""

import asyncio
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from decentrl.coordinator.http.errors import ApiError, Reason

Body = TypeVar("Body", bound=BaseModel)


def describe(error: ValidationError) -> str:
    """One line per problem (at most five): `rollouts.0.slot: Input should be ... (got -1)`."""
    parts = []
    for item in error.errors()[:5]:
        where = ".".join(str(part) for part in item["loc"]) or "body"
        if item["type"] == "json_invalid":
            parts.append(f"body is not valid JSON ({item.get('ctx', {}).get('error', item['msg'])})")
        else:
            parts.append(f"{where}: {item['msg']}")
    more = f" (+{error.error_count() - 5} more)" if error.error_count() > 5 else ""
    return "; ".join(parts) + more


def check_declared_size(request: Request, limit: int) -> None:
    declared = request.headers.get("content-length", "0")
    if not declared.isdigit() or int(declared) > limit:
        raise ApiError(
            413, f"request body of {declared} bytes exceeds the limit of {limit} bytes", Reason.OVERSIZED
        )


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused with 413 past `limit` bytes (declared or actually sent) before parsing,
    and with 408 when it trickles in slower than `trust.body_timeout_seconds` (slow-client defence).
    Read once per request: the signature check and the route share it through `request.state`."""
    cached = getattr(request.state, "body", None)
    if cached is not None:
        return cached
    check_declared_size(request, limit)
    chunks, size = [], 0
    timeout = request.app.state.context.run.trust.body_timeout_seconds
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"request body exceeds the limit of {limit} bytes", Reason.OVERSIZED)
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"request body not received within {timeout:g}s", Reason.SLOW_BODY) from None
    request.state.body = b"".join(chunks)
    return request.state.body


async def parse(request: Request, model: type[Body], limit: int) -> Body:
    body = await read_body(request, limit)
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        raise ApiError(422, describe(error), Reason.SCHEMA) from None
