"""Budgets on the costly steps of ingestion: how much of the coordinator's time one worker's
submissions may cost.

Two steps cost time in proportion to what a worker sends: replaying episodes (environment code for
every tool turn, on the request path) and scoring rewards (after the answer, in the scoring pool:
`scoring.py`; the code environment runs hidden tests in the sandbox, up to its wall limit). Both
run only for submissions that bound to the worker's own open slots (`ingest.bind`), so how much a
worker can have queued is bounded by its lease allowance. Two limits keep even bound submissions
from crowding others out:

- per worker, a token bucket of scoring *seconds* (`trust.scoring_seconds_per_second`, burst
  `trust.scoring_burst_seconds`): a submission is admitted while the worker holds at least one
  second of credit, and the time its replay took is then charged, and the time each of its
  rollouts held a pool process when that reward is scored (`charge`); a worker whose rollouts are
  slow to replay or to score (a 4,000-rollout flood, code that runs to the sandbox's limit) pays
  with its own throughput: 429 until the bucket refills, never a strike (slowness proves nothing);
- overall, at most `service.scoring_concurrency` submissions are replayed at once; the others wait
  for a slot without holding a server thread, so leases, batches and `/v1/health` go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread

from decentrl.coordinator.context import Context
from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.trust.ratelimit import RateLimiter

Result = TypeVar("Result")


class ScoringBudget:
    def __init__(self, context: Context) -> None:
        trust = context.run.trust
        self.context = context
        self.seconds = RateLimiter(trust.scoring_seconds_per_second, trust.scoring_burst_seconds)
        self.slots = anyio.CapacityLimiter(context.run.service.scoring_concurrency)
        self.spent = 0.0
        self.pool_spent = 0.0
        context.scoring.charge = self.charge

    def charge(self, worker_id: str, seconds: float) -> None:
        """Charge `seconds` of scoring-pool time to `worker_id` (called from the pool's threads)."""
        self.pool_spent += seconds
        self.seconds.charge(worker_id, self.context.clock(), seconds)

    async def run(self, worker_id: str, score: Callable[..., Result], *args: object) -> Result:
        """`score(*args)` in a scoring slot, charged to `worker_id`; 429 when its budget is spent."""
        if self.seconds.exhausted(worker_id, self.context.clock()):
            rate = self.seconds.rate
            detail = (
                f"scoring budget spent (trust.scoring_seconds_per_second={rate:g}); your submissions"
                " cost more coordinator time than that: slow down and retry"
            )
            raise ApiError(429, detail, Reason.SCORING_BUDGET, {"Retry-After": f"{1.0 / rate:.0f}"})
        elapsed: list[float] = []

        def timed() -> Result:  # time in the slot only: waiting for one is not the worker's cost
            started = time.monotonic()
            try:
                return score(*args)
            finally:
                elapsed.append(time.monotonic() - started)

        try:
            return await anyio.to_thread.run_sync(timed, limiter=self.slots)
        finally:
            self.spent += sum(elapsed)
            self.seconds.charge(worker_id, self.context.clock(), sum(elapsed))
