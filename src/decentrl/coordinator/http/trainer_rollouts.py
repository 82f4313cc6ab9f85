"""`POST /v1/trainer/leases` and `POST /v1/trainer/rollouts`: the trainer's own rollouts.

A colocated trainer (`trainer.local_groups > 0`, docs/trainer.md) samples groups with its live
model and sends them here with the trainer token, one lease and one submission per round, as the
worker id `LOCAL_WORKER`. They take the workers' path through the store (`leasing.grant_lease`,
`ingest.bind` / `replay` / `accept`): the same tasks from the run's seed stream, the same binding
checks, the same replay and trusted reward in the scoring pool, the same groups, batches and
staleness accounting, and the answer still follows the commit. What judges an untrusted sender is
left out: the per-worker lease allowance (only `max_pending_groups` bounds the trainer), the
scoring budget, the repeated-completion detector and sampled verification.
"""

from collections.abc import Callable

from fastapi import Depends, FastAPI, Request, Response
from starlette.concurrency import run_in_threadpool

from decentrl.coordinator.context import Context
from decentrl.coordinator.http.body import parse
from decentrl.coordinator.pipeline import ingest, leasing
from decentrl.coordinator.pipeline.leasing import LOCAL_WORKER
from decentrl.protocol import API_PREFIX, LeaseRequest, RolloutSubmission


def add_local_rollout_routes(
    app: FastAPI, context: Context, trainer: Callable, answer: Callable[..., Response]
) -> None:
    """`answer` turns a wire type into the JSON response (app.py's `wire_response`)."""
    limit = context.config.max_body_bytes

    @app.post(f"{API_PREFIX}/trainer/leases", dependencies=[Depends(trainer)], response_model=None)
    async def local_lease(request: Request) -> Response:
        context.disk.check()
        body = await parse(request, LeaseRequest, limit)
        if context.roles.complete is not None:
            return Response(status_code=204)
        # No long poll: a trainer with no room trains on what is ready instead of waiting here.
        granted = await run_in_threadpool(leasing.grant_lease, context, LOCAL_WORKER, body, True)
        return Response(status_code=204) if granted is None else answer(granted)

    @app.post(f"{API_PREFIX}/trainer/rollouts", dependencies=[Depends(trainer)])
    async def local_rollouts(request: Request) -> Response:
        context.disk.check()
        body = await parse(request, RolloutSubmission, limit)
        await run_in_threadpool(ingest.bind, context, LOCAL_WORKER, body)
        replayed = await run_in_threadpool(ingest.replay, context, body)
        result = await run_in_threadpool(ingest.accept, context, LOCAL_WORKER, body, replayed)
        context.ready.notify()
        return answer(result)
