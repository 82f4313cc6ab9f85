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

Parsing a submission costs time too (pydantic walks every token of every rollout), and it comes
before binding, so it is bounded before a byte is read: a worker out of credit gets 429 (`admit`),
and a submission may carry at most the bytes of as many rollouts as the worker holds open slots
(`submission_limit`, each rollout at its largest honest size), else 413 without parsing; the
parse time is then charged like the replay's. A 4,000-rollout submission from a worker holding
eight slots is refused after reading eight rollouts' worth of bytes.
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

# Upper bounds of a compact JSON rollout's parts (pydantic writes floats in at most 24 characters)
LOGPROB_BYTES = 25
VERSION_BYTES = 11
SEGMENT_BYTES = 128
ROLLOUT_FIXED_BYTES = 2048
SUBMISSION_FIXED_BYTES = 64


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

    def charge_parse(self, worker_id: str, seconds: float) -> None:
        """Charge the seconds a submission's parse took (on the request path, before binding)."""
        self.spent += seconds
        self.seconds.charge(worker_id, self.context.clock(), seconds)

    def admit(self, worker_id: str) -> None:
        """429 unless `worker_id` holds at least a second of credit."""
        if self.seconds.exhausted(worker_id, self.context.clock()):
            rate = self.seconds.rate
            detail = (
                f"scoring budget spent (trust.scoring_seconds_per_second={rate:g}); your submissions"
                " cost more coordinator time than that: slow down and retry"
            )
            raise ApiError(429, detail, Reason.SCORING_BUDGET, {"Retry-After": f"{1.0 / rate:.0f}"})

    async def run(self, worker_id: str, score: Callable[..., Result], *args: object) -> Result:
        """`score(*args)` in a scoring slot, charged to `worker_id`; 429 when its budget is spent."""
        self.admit(worker_id)
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


def rollout_bytes(context: Context) -> int:
    """The largest compact JSON an honest rollout can take: its fixed fields, the free-form budget,
    every model token with its log-prob and version, and prompt and environment tokens up to the
    model's context (None: no bound, `coordinator.max_body_bytes` alone applies)."""
    config, limit = context.config, context.model.max_context
    if limit is None:
        return config.max_body_bytes
    digits = len(str(context.model.vocab_size)) + 1  # a token id and its comma
    model_token = digits + LOGPROB_BYTES + VERSION_BYTES
    segments = 2 * context.env.max_turns + 1  # model and environment turns alternate
    fixed = ROLLOUT_FIXED_BYTES + SEGMENT_BYTES * segments
    return fixed + config.max_transcript_bytes + model_token * config.max_new_tokens + 2 * digits * limit


def submission_limit(context: Context, worker_id: str) -> int:
    """Bytes a submission from `worker_id` may take: one honest rollout's worth per unfilled slot of
    its leases (those expired within `lease_seconds` too, whose late answer deserves its precise
    410), at least one, at most `coordinator.max_body_bytes`."""
    config = context.config
    with context.store.transaction() as db:
        slots = db.execute(
            "SELECT COUNT(*) FROM leases l JOIN lease_slots ls ON ls.lease_id = l.lease_id"
            " JOIN slots s ON s.task_id = ls.task_id AND s.slot = ls.slot"
            " WHERE l.worker_id = ? AND l.deadline >= ? AND s.rollout_id IS NULL",
            (worker_id, context.clock() - config.lease_seconds),
        ).fetchone()[0]
    return min(config.max_body_bytes, SUBMISSION_FIXED_BYTES + max(1, slots) * rollout_bytes(context))
