"""The coordinator's HTTP API (`/v1`), the only server of a run. See docs/protocol.md.

Routes are thin: authenticate, read a bounded body, parse it strictly, call the module that owns
the logic (leasing, ingest, batching, snapshots, metrics), answer after the commit. Database work
runs in the thread pool so a slow fsync never blocks the event loop. (No `from __future__ import
annotations` here: FastAPI must see the real `Depends(...)` objects in the route signatures.)
"""

import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Annotated

from fastapi import Depends, FastAPI, Header, Request, Response
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from decentrl.config import COORDINATOR_SECTIONS, RunConfig, shareable
from decentrl.coordinator import metrics, route_latency
from decentrl.coordinator.context import Context, build_context
from decentrl.coordinator.db.store import forget_nonces
from decentrl.coordinator.env_servers import add_envd_routes
from decentrl.coordinator.http.body import parse, read_body
from decentrl.coordinator.http.budget import KnownTokens, RequestBudget
from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.coordinator.http.openapi import document_bodies
from decentrl.coordinator.http.trainer_rollouts import add_local_rollout_routes
from decentrl.coordinator.http.trainer_run import add_run_routes
from decentrl.coordinator.pipeline import batching, ingest, leasing
from decentrl.coordinator.pipeline.scoring_budget import ScoringBudget, submission_limit
from decentrl.coordinator.role_watch import SeenMiddleware
from decentrl.coordinator.stage_relay import add_relay_routes
from decentrl.coordinator.stage_routing import add_stage_routes
from decentrl.coordinator.status import StatusReporter
from decentrl.coordinator.trust import auth, reputation, verification
from decentrl.coordinator.trust.gate import RELAY_PATH, Gate
from decentrl.coordinator.wakeup import long_poll
from decentrl.coordinator.weights.routes import add_weight_routes
from decentrl.coordinator.weights.versions import WeightStore
from decentrl.monitor.dashboard import add_dashboard_routes, dashboard_token
from decentrl.monitor.trackers import StatsLogger, open_trackers
from decentrl.protocol import (
    API_PREFIX,
    BatchAck,
    BatchRequest,
    Lease,
    LeaseRequest,
    RegisterRequest,
    RolloutSubmission,
    ScoreJobsRequest,
    ServerInfo,
    StepMetrics,
    TermScoreBatch,
    TrainBatch,
    VerdictBatch,
    VerifyJobsRequest,
)

log = logging.getLogger(__name__)

ROLLOUTS_PATH = f"{API_PREFIX}/rollouts"
SWEEP_SECONDS = 1.0
SAVE_BUCKETS_EVERY = 5
"""Sweeps between two saves of the rate-limit buckets (a kill -9 forgets at most this many seconds)."""


def _sweeper(context: Context, gate: Gate, stop: threading.Event) -> None:
    sweeps = 0
    while not stop.wait(SWEEP_SECONDS):
        sweeps += 1
        try:
            if leasing.sweep(context):
                context.room.notify()
            if sweeps % SAVE_BUCKETS_EVERY == 0:
                gate.save_buckets()
                with context.store.transaction() as db:
                    forget_nonces(db, context.clock())
        except Exception:  # keep sweeping; a failed sweep is retried in a second and on every lease
            log.exception("lease sweep failed")
    gate.save_buckets()


async def _body_limit(context: Context, scoring: ScoringBudget, request: Request, worker_id: str) -> int:
    """Bytes the body of `worker_id`'s request may take (see `Gate.body_limit`)."""
    if request.method == "POST" and request.url.path == ROLLOUTS_PATH:
        scoring.admit(worker_id)  # out of credit: refused before its body costs anything
        return await run_in_threadpool(submission_limit, context, worker_id)
    if request.url.path.startswith(RELAY_PATH):
        return context.config.relay_max_body_bytes
    return context.config.max_body_bytes


def add_error_handlers(app: FastAPI, known: KnownTokens) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer", **error.headers} if error.status == 401 else error.headers
        return JSONResponse({"detail": error.detail}, status_code=error.status, headers=headers)

    @app.exception_handler(ClientDisconnect)
    async def client_disconnect(request: Request, error: ClientDisconnect) -> Response:
        # The client left before its request was read: nobody is there to answer, nothing broke.
        if known.disconnected():
            log.info(
                "%d clients so far disconnected before their request was read (/metrics counts them)",
                known.client_disconnects,
            )
        return Response(status_code=400)


def create_app(
    config: RunConfig, run_dir: Path, model_dir: Path, clock: Callable[[], float] = time.time
) -> FastAPI:
    context = build_context(config, run_dir, model_dir, clock)
    tokens = auth.load_tokens(run_dir, config.coordinator)
    known = KnownTokens(failed_auths_per_minute=config.trust.failed_auths_per_address_per_minute)
    known.trust(auth.hash_token(tokens.trainer))
    scoring = ScoringBudget(context)
    body_limit = partial(_body_limit, context, scoring)
    gate = Gate(context, read_body, known, body_limit)
    trackers = open_trackers(config.monitor, run_dir, "coordinator", shareable(config))
    stats_logger = StatsLogger(
        lambda: metrics.stats(context, known.stats()), trackers, config.monitor.stats_every_seconds
    )
    reporter = StatusReporter(context)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stop = threading.Event()
        thread = threading.Thread(
            target=_sweeper, args=(context, gate, stop), name="lease-sweeper", daemon=True
        )
        thread.start()
        resumed = context.scoring.resume()  # rewards still pending when the coordinator last stopped
        if resumed:
            log.info("scoring %d rollouts left pending by the last run", resumed)
        stats_logger.start()
        reporter.start()
        yield
        reporter.stop()
        stop.set()
        thread.join()
        stats_logger.stop()  # logs the final statistics, so before the store closes
        context.scoring.close()  # before the store: a late result is rescored at the next start
        context.store.close()

    app = FastAPI(title="decentrl coordinator", lifespan=lifespan)
    app.add_middleware(RequestBudget, config=config.service, known=known)
    app.add_middleware(SeenMiddleware, watch=context.roles)
    app.state.context = context
    app.state.tokens = tokens
    app.state.known = known
    app.state.connections = None  # the server's ConnectionBook, set by `server.serve`

    add_error_handlers(app, known)

    async def enrollment(request: Request, authorization: Annotated[str | None, Header()] = None) -> str:
        """The caller's address, once registration is allowed (see `trust.registration`)."""
        return await gate.enrollment(request, authorization, tokens.enroll)

    def trainer(request: Request, authorization: Annotated[str | None, Header()] = None) -> None:
        if not auth.same_token(auth.bearer_token(authorization), tokens.trainer):
            known.auth_failed(request.client.host if request.client else "")
            raise ApiError(
                401, "invalid trainer token; use the one in the coordinator's tokens.json", Reason.AUTH
            )

    async def worker(request: Request, authorization: Annotated[str | None, Header()] = None) -> str:
        return await gate.worker(request, authorization)

    async def client(request: Request, authorization: Annotated[str | None, Header()] = None) -> str:
        """A worker or the trainer."""
        if auth.same_token(auth.bearer_token(authorization), tokens.trainer):
            return "trainer"
        return await gate.worker(request, authorization)

    async def anonymous(request: Request) -> None:
        """Anyone, within the per-address request rate."""
        await gate.anonymous(request)

    @app.post(f"{API_PREFIX}/workers/challenge", dependencies=[Depends(anonymous)])
    def challenge() -> dict:
        return auth.issue_challenge(context).model_dump()

    add_worker_routes(app, context, enrollment, worker, scoring, body_limit)
    add_trainer_routes(app, context, trainer)
    add_local_rollout_routes(app, context, trainer, wire_response)
    add_verifier_routes(app, context, trainer)
    add_scorer_routes(app, context, trainer)
    add_run_routes(app, context, trainer, reporter.finish)
    weights = add_weight_routes(app, context, trainer, worker, client)
    relay = add_relay_routes(app, context, worker)
    add_stage_routes(app, context, worker, client, relay)
    add_envd_routes(app, context, trainer, client)
    add_read_routes(app, context, client, weights, known)
    add_dashboard(app, context, run_dir)
    document_bodies(app)
    return app


def add_dashboard(app: FastAPI, context: Context, run_dir: Path) -> None:
    """The read-only dashboard (monitor/dashboard.py) behind its own token."""
    tokenizer = context.model.tokenizer
    app.state.dashboard_token = dashboard_token(run_dir, context.run.monitor.dashboard_token)
    add_dashboard_routes(
        app,
        run_dir,
        app.state.dashboard_token,
        decode=lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False),
        peers=lambda: {peer.worker_id: peer.version for peer in app.state.peers.listing("")},
        clock=context.clock,
        run_state=lambda: metrics.run_state(context),
        draw=lambda seed: context.env.problem(seed, "train").images,
    )


def wire_response(answer: BaseModel) -> Response:
    """A wire type as JSON, serialised by pydantic's compiled serialiser. Returning `model_dump()`
    instead makes FastAPI walk the dict element by element on the event loop (`jsonable_encoder`):
    for a trainer batch of 8 x 4,000 tokens that was 35 % of the coordinator's CPU samples."""
    return Response(answer.model_dump_json(), media_type="application/json")


def long_poll_waiters(context: Context) -> int:
    """Lease (or batch) requests that may wait at once: a quarter of the request budget."""
    return max(1, context.run.service.max_requests_in_flight // 4)


def add_worker_routes(
    app: FastAPI,
    context: Context,
    enrollment: Callable,
    worker: Callable,
    scoring: ScoringBudget,
    body_limit: Callable,
) -> None:
    limit = context.config.max_body_bytes
    max_waiters = long_poll_waiters(context)

    @app.post(f"{API_PREFIX}/workers/register")
    async def register(request: Request, address: Annotated[str, Depends(enrollment)]) -> Response:
        body = await parse(request, RegisterRequest, limit)
        registered = await run_in_threadpool(auth.register_worker, context, body, address)
        context.scoring.prepare()  # its rollouts will need the scorers: they start while it loads
        return wire_response(registered)

    @app.post(f"{API_PREFIX}/leases", response_model=None)
    async def lease(request: Request, worker_id: Annotated[str, Depends(worker)]) -> Response:
        context.disk.check()
        body = await parse(request, LeaseRequest, limit)
        if body.hop_timings:  # once, before the long poll: its attempts pick routes by them
            await run_in_threadpool(route_latency.record, context, worker_id, body.hop_timings)
        if context.roles.complete is not None:  # the run has ended: nothing more to sample
            return Response(status_code=204, headers=context.roles.header())

        async def attempt() -> Lease | None:
            return await run_in_threadpool(leasing.grant_lease, context, worker_id, body)

        granted = await long_poll(attempt, context.room, body.wait_seconds, max_waiters)
        if granted is None:  # nothing to lease: say so when the run waits on a missing role
            return Response(status_code=204, headers=context.roles.header())
        return wire_response(granted)

    @app.post(ROLLOUTS_PATH)
    async def rollouts(request: Request, worker_id: Annotated[str, Depends(worker)]) -> Response:
        context.disk.check()
        started = time.monotonic()
        try:
            body = await parse(request, RolloutSubmission, await body_limit(request, worker_id))
        except ApiError as error:
            await run_in_threadpool(reputation.record_rejection, context, worker_id, error.reason)
            raise
        finally:  # parsing walks every token before anything binds: the sender pays for it
            scoring.charge_parse(worker_id, time.monotonic() - started)
        # authenticate (above) -> bind -> replay -> accept: nothing costly runs for a submission that
        # does not bind to the worker's own open slots, and the replay is budgeted per worker.
        await run_in_threadpool(ingest.bind, context, worker_id, body)
        replayed = await scoring.run(worker_id, ingest.replay, context, body)
        result = await run_in_threadpool(ingest.accept, context, worker_id, body, replayed)
        context.ready.notify()
        context.room.notify()  # the submitting worker's open groups are answered (lease_allowance)
        return wire_response(result)


def add_trainer_routes(app: FastAPI, context: Context, trainer: Callable) -> None:
    limit = context.config.max_body_bytes
    max_waiters = long_poll_waiters(context)

    @app.post(f"{API_PREFIX}/trainer/batches", dependencies=[Depends(trainer)], response_model=None)
    async def batches(request: Request) -> Response:
        body = await parse(request, BatchRequest, limit)

        async def attempt() -> TrainBatch | None:
            return await run_in_threadpool(batching.next_batch, context, body)

        batch = await long_poll(attempt, context.ready, body.wait_seconds, max_waiters)
        if batch is None:
            return Response(status_code=204, headers=context.roles.header())
        batch.snapshot_requested = await run_in_threadpool(request.app.state.weights.snapshot_requested)
        return wire_response(batch)

    @app.post(f"{API_PREFIX}/trainer/batches/{{batch_id}}/ack", dependencies=[Depends(trainer)])
    async def ack(batch_id: str, request: Request) -> dict:
        body = await parse(request, BatchAck, limit)
        answer = await run_in_threadpool(batching.ack_batch, context, batch_id, body)
        context.room.notify()  # its groups no longer count against max_pending_groups
        # A trainer that fetched its next batch before a worker asked for a snapshot hears of it here.
        return answer | {
            "snapshot_requested": await run_in_threadpool(request.app.state.weights.snapshot_requested)
        }

    @app.post(f"{API_PREFIX}/trainer/metrics", dependencies=[Depends(trainer)])
    async def step_metrics(request: Request) -> dict:
        body = await parse(request, StepMetrics, limit)
        alarms = await run_in_threadpool(batching.store_metrics, context, body)
        return {"stored": body.policy_version, "alarms": alarms}


def add_scorer_routes(app: FastAPI, context: Context, trainer: Callable) -> None:
    """The trusted reward scorer (trainer token) takes reward-model terms and posts their scores."""
    limit = context.config.max_body_bytes

    @app.post(f"{API_PREFIX}/scorer/jobs", dependencies=[Depends(trainer)])
    async def score_jobs(request: Request) -> dict:
        body = await parse(request, ScoreJobsRequest, limit)
        return (await run_in_threadpool(context.scoring.next_jobs, body)).model_dump()

    @app.post(f"{API_PREFIX}/scorer/scores", dependencies=[Depends(trainer)])
    async def scores(request: Request) -> dict:
        body = await parse(request, TermScoreBatch, limit)
        answer = await run_in_threadpool(context.scoring.record_scores, body)
        context.ready.notify()
        return answer


def add_verifier_routes(app: FastAPI, context: Context, trainer: Callable) -> None:
    """The trusted verifier (trainer token) takes sampled rollouts and reports what it measured."""
    limit = context.config.max_body_bytes

    @app.post(f"{API_PREFIX}/verifier/jobs", dependencies=[Depends(trainer)])
    async def verify_jobs(request: Request) -> Response:
        body = await parse(request, VerifyJobsRequest, limit)
        return wire_response(await run_in_threadpool(verification.next_jobs, context, body))

    @app.post(f"{API_PREFIX}/verifier/verdicts", dependencies=[Depends(trainer)])
    async def verdicts(request: Request) -> dict:
        body = await parse(request, VerdictBatch, limit)
        answer = await run_in_threadpool(verification.record_verdicts, context, body)
        context.ready.notify()
        return answer


def add_read_routes(
    app: FastAPI, context: Context, client: Callable, weights: WeightStore, known: KnownTokens
) -> None:
    @app.get(f"{API_PREFIX}/health", response_model=None)
    async def health() -> dict | JSONResponse:
        # On the event loop, from memory: it must answer while the thread pool and the store are busy.
        latest = max((key[0] for key in list(weights.manifests)), default=None)
        if context.disk.low():
            free = context.disk.free_bytes() >> 20
            body = {"status": "disk_low", "free_mb": free, "latest_version": latest}
            return JSONResponse(body, status_code=503)
        return {"status": "ok", "latest_version": latest}

    @app.get(f"{API_PREFIX}/info")
    def info(caller: Annotated[str, Depends(client)]) -> dict:
        if caller == "trainer":  # its run is starting: rollouts (a colocated trainer's, soon) follow
            context.scoring.prepare()
        latest = weights.latest()
        return ServerInfo(
            run_id=context.run_id,
            vocab_size=context.model.vocab_size,
            eos_token_ids=list(context.model.eos_token_ids),
            pad_token_id=context.model.pad_token_id,
            group_size=context.config.group_size,
            max_staleness=context.config.max_staleness,
            sampling=context.sampling,
            latest_version=None if latest is None else latest.version,
            model_files=list(context.model.files),
            trainer_public_key=weights.trainer_key(),
            stage_keys=weights.stage_keys(),
            env_args=context.env_args,
            logprob_tolerances=context.tolerances.as_dict(),
            sections={name: getattr(context.run, name).model_dump() for name in COORDINATOR_SECTIONS},
            stage_map=weights.stage_map,
        ).model_dump()

    @app.get(f"{API_PREFIX}/model/files/{{name}}", dependencies=[Depends(client)])
    def model_file(name: str) -> FileResponse:
        if name not in context.model.files:
            raise ApiError(
                404,
                f"no model file {name!r}; available: {', '.join(context.model.files)}",
                Reason.UNKNOWN_FILE,
            )
        return FileResponse(context.model_dir / name)

    @app.get(f"{API_PREFIX}/data/{{digest}}", dependencies=[Depends(client)])
    def data_file(digest: str) -> Response:
        content = context.data_file(digest)
        if content is None:
            raise ApiError(404, f"no data file with sha256 {digest!r}", Reason.UNKNOWN_FILE)
        return Response(content, media_type="application/octet-stream")

    @app.get(f"{API_PREFIX}/stats", dependencies=[Depends(client)])
    def stats() -> dict:
        return metrics.stats(context, known.stats())

    scraped = metrics.CachedStats(context, known.stats)

    @app.get("/metrics")
    def prometheus() -> PlainTextResponse:
        text = metrics.prometheus(scraped.get())  # unauthenticated: computed at most every 5 s
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")
