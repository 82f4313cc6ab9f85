"""The coordinator's HTTP API (`/v1`), the only server of a run. See docs/protocol.md.

Routes are thin: authenticate, read a bounded body, parse it strictly, call the module that owns
the logic (leasing, ingest, batching, snapshots, metrics), answer after the commit. Database work
runs in the thread pool so a slow fsync never blocks the event loop. (No `from __future__ import
annotations` here: FastAPI must see the real `Depends(...)` objects in the route signatures.)
"""

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, TypeVar

from fastapi import Depends, FastAPI, Header, Request, Response
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from decentrl.config import RunConfig
from decentrl.coordinator import auth, batching, ingest, leasing, metrics, verification
from decentrl.coordinator.context import ApiError, Context, build_context
from decentrl.coordinator.gate import Gate
from decentrl.coordinator.snapshots import WeightStore
from decentrl.coordinator.weight_routes import add_weight_routes
from decentrl.protocol import (
    API_PREFIX,
    BatchAck,
    BatchRequest,
    LeaseRequest,
    RegisterRequest,
    RolloutSubmission,
    ServerInfo,
    StepMetrics,
    VerdictBatch,
    VerifyJobsRequest,
)

log = logging.getLogger(__name__)

SWEEP_SECONDS = 1.0
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
            413, f"request body of {declared} bytes exceeds the limit of {limit} bytes", "oversized"
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
                    raise ApiError(413, f"request body exceeds the limit of {limit} bytes", "oversized")
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"request body not received within {timeout:g}s", "slow_body") from None
    request.state.body = b"".join(chunks)
    return request.state.body


async def parse(request: Request, model: type[Body], limit: int) -> Body:
    body = await read_body(request, limit)
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        raise ApiError(422, describe(error), "schema") from None


def _sweeper(context: Context, stop: threading.Event) -> None:
    while not stop.wait(SWEEP_SECONDS):
        try:
            leasing.sweep(context)
        except Exception:  # keep sweeping; a failed sweep is retried in a second and on every lease
            log.exception("lease sweep failed")


def create_app(
    config: RunConfig, run_dir: Path, model_dir: Path, clock: Callable[[], float] = time.time
) -> FastAPI:
    context = build_context(config, run_dir, model_dir, clock)
    tokens = auth.load_tokens(run_dir, config.coordinator)
    gate = Gate(context, read_body)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stop = threading.Event()
        thread = threading.Thread(target=_sweeper, args=(context, stop), name="lease-sweeper", daemon=True)
        thread.start()
        yield
        stop.set()
        thread.join()
        context.store.close()

    app = FastAPI(title="decentrl coordinator", lifespan=lifespan)
    app.state.context = context
    app.state.tokens = tokens

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
        return JSONResponse({"detail": error.detail}, status_code=error.status, headers=headers)

    async def enrollment(request: Request, authorization: Annotated[str | None, Header()] = None) -> str:
        """The caller's address, once registration is allowed (see `trust.registration`)."""
        return await gate.enrollment(request, authorization, tokens.enroll)

    def trainer(authorization: Annotated[str | None, Header()] = None) -> None:
        if not auth.same_token(auth.bearer_token(authorization), tokens.trainer):
            raise ApiError(401, "invalid trainer token; use the one in the coordinator's tokens.json", "auth")

    async def worker(request: Request, authorization: Annotated[str | None, Header()] = None) -> str:
        return await gate.worker(request, authorization)

    async def client(request: Request, authorization: Annotated[str | None, Header()] = None) -> str:
        """A worker or the trainer."""
        if auth.same_token(auth.bearer_token(authorization), tokens.trainer):
            return "trainer"
        return await gate.worker(request, authorization)

    add_worker_routes(app, context, enrollment, worker)
    add_trainer_routes(app, context, trainer)
    add_verifier_routes(app, context, trainer)
    weights = add_weight_routes(app, context, trainer, worker, client)
    add_read_routes(app, context, client, weights)
    return app


def add_worker_routes(app: FastAPI, context: Context, enrollment: Callable, worker: Callable) -> None:
    limit = context.config.max_body_bytes

    @app.post(f"{API_PREFIX}/workers/register")
    async def register(request: Request, address: Annotated[str, Depends(enrollment)]) -> dict:
        body = await parse(request, RegisterRequest, limit)
        return (await run_in_threadpool(auth.register_worker, context, body, address)).model_dump()

    @app.post(f"{API_PREFIX}/leases", response_model=None)
    async def lease(request: Request, worker_id: Annotated[str, Depends(worker)]) -> dict | Response:
        body = await parse(request, LeaseRequest, limit)
        granted = await run_in_threadpool(leasing.grant_lease, context, worker_id, body)
        return Response(status_code=204) if granted is None else granted.model_dump()

    @app.post(f"{API_PREFIX}/rollouts")
    async def rollouts(request: Request, worker_id: Annotated[str, Depends(worker)]) -> dict:
        try:
            body = await parse(request, RolloutSubmission, limit)
        except ApiError as error:
            await run_in_threadpool(ingest.record_rejection, context, worker_id, error.reason)
            raise
        return (await run_in_threadpool(ingest.submit, context, worker_id, body)).model_dump()


def add_trainer_routes(app: FastAPI, context: Context, trainer: Callable) -> None:
    limit = context.config.max_body_bytes

    @app.post(f"{API_PREFIX}/trainer/batches", dependencies=[Depends(trainer)], response_model=None)
    async def batches(request: Request) -> dict | Response:
        body = await parse(request, BatchRequest, limit)
        batch = await run_in_threadpool(batching.next_batch, context, body)
        if batch is None:
            return Response(status_code=204)
        batch.snapshot_requested = await run_in_threadpool(request.app.state.weights.snapshot_requested)
        return batch.model_dump()

    @app.post(f"{API_PREFIX}/trainer/batches/{{batch_id}}/ack", dependencies=[Depends(trainer)])
    async def ack(batch_id: str, request: Request) -> dict:
        body = await parse(request, BatchAck, limit)
        return await run_in_threadpool(batching.ack_batch, context, batch_id, body)

    @app.post(f"{API_PREFIX}/trainer/metrics", dependencies=[Depends(trainer)])
    async def step_metrics(request: Request) -> dict:
        body = await parse(request, StepMetrics, limit)
        await run_in_threadpool(batching.store_metrics, context, body)
        return {"stored": body.policy_version}


def add_verifier_routes(app: FastAPI, context: Context, trainer: Callable) -> None:
    """The trusted verifier (trainer token) takes sampled rollouts and reports what it measured."""
    limit = context.config.max_body_bytes

    @app.post(f"{API_PREFIX}/verifier/jobs", dependencies=[Depends(trainer)])
    async def verify_jobs(request: Request) -> dict:
        body = await parse(request, VerifyJobsRequest, limit)
        return (await run_in_threadpool(verification.next_jobs, context, body)).model_dump()

    @app.post(f"{API_PREFIX}/verifier/verdicts", dependencies=[Depends(trainer)])
    async def verdicts(request: Request) -> dict:
        body = await parse(request, VerdictBatch, limit)
        return await run_in_threadpool(verification.record_verdicts, context, body)


def add_read_routes(app: FastAPI, context: Context, client: Callable, weights: WeightStore) -> None:
    @app.get(f"{API_PREFIX}/health")
    def health() -> dict:
        latest = weights.latest()
        return {"status": "ok", "latest_version": None if latest is None else latest.version}

    @app.get(f"{API_PREFIX}/info", dependencies=[Depends(client)])
    def info() -> dict:
        latest = weights.latest()
        return ServerInfo(
            run_id=context.run_id,
            vocab_size=context.model.vocab_size,
            eos_token_id=context.model.eos_token_ids[0],
            pad_token_id=context.model.pad_token_id,
            group_size=context.config.group_size,
            max_staleness=context.config.max_staleness,
            sampling=context.sampling,
            latest_version=None if latest is None else latest.version,
            model_files=list(context.model.files),
            trainer_public_key=weights.trainer_key(),
            env_args=context.run.task.args,
        ).model_dump()

    @app.get(f"{API_PREFIX}/model/files/{{name}}", dependencies=[Depends(client)])
    def model_file(name: str) -> FileResponse:
        if name not in context.model.files:
            raise ApiError(
                404, f"no model file {name!r}; available: {', '.join(context.model.files)}", "unknown_file"
            )
        return FileResponse(context.model_dir / name)

    @app.get(f"{API_PREFIX}/stats", dependencies=[Depends(client)])
    def stats() -> dict:
        return metrics.stats(context)

    @app.get("/metrics")
    def prometheus() -> PlainTextResponse:
        text = metrics.prometheus(metrics.stats(context))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")
