"""The worker loop: stay on the latest weights → lease → generate → submit, until stopped.

The network waits overlap generation: a lease's submission goes out in a background thread while
the next lease is generated (one submission in flight, in order), the next lease and the latest
version are asked while the current one generates, and a newer version is fetched, verified and
merged in a background thread of its own (one at a time) while the engine keeps generating on the
version it holds. The engine's weights change only between generations, when a finished fetch is
copied in. So a worker is never idle waiting for weights; it may generate one lease on the version
before the latest, which the staleness bound already allows. The first version, and the catch-up
after a lease refused as stale, load before generation goes on.

A worker must survive a bad answer: rejections are logged and counted, and only a long run of
consecutive ones (a misconfigured or banned worker) ends it with exit code 2. A rejection of a
background request is raised in the loop at its next step, and handled there like any other.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

from decentrl.client import CoordinatorClient, RequestRejected
from decentrl.config import WorkerConfig
from decentrl.engines.base import InferenceEngine
from decentrl.envs.player import Player, lease_seed
from decentrl.monitor.reporting import Every
from decentrl.protocol import Lease, LeaseRequest, Rollout, RolloutSubmission, WeightsInfo
from decentrl.stage_wire import StageReport
from decentrl.worker.pipeline_engine import HopFailed, PipelineEngine, VersionGone
from decentrl.worker.weights import Loaded, WorkerWeights

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_REJECTIONS = 20
IDLE_SECONDS = 0.05
LEASE_WAIT_SECONDS = 1.0
"""With no work to lease, the coordinator holds the request this long for room (a long poll)."""
LEASE_MARGIN_SECONDS = 2.0
"""A prefetched lease this close to its deadline is left to expire and a fresh one taken."""


def attach_traces(engine: PipelineEngine, rollout: Rollout) -> None:
    """Give each model segment of a staged rollout the trace of the generation that produced it."""
    context, traces = list(rollout.prompt_token_ids), []
    for segment in rollout.segments:
        if segment.source == "model":
            trace = engine.take_trace(context, segment.token_ids)
            assert trace is not None, "every model segment came from one generation of this lease"
            traces.append(trace)
        context += segment.token_ids
    rollout.stage_traces = traces


class Worker:
    def __init__(
        self,
        client: CoordinatorClient,
        engine: InferenceEngine,
        config: WorkerConfig,
        stop: threading.Event,
        player: Player,
        weights: WorkerWeights,
    ):
        self.client = client
        self.engine = engine
        self.player = player
        self.config = config
        self.stop = stop
        self.rejections: Counter[int] = Counter()
        self.consecutive_rejections = 0
        self.num_submissions = 0
        self.num_rollouts = 0
        self.num_tokens = 0
        self.weights = weights
        self.status_due = Every()
        self.hops_failed: Counter[str] = Counter()
        """Leases given up because a stage holder of their route failed, by reason."""

    def run(self) -> int:
        """Exit code: 0 when stopped, 2 after too many consecutive rejections."""
        background = ThreadPoolExecutor(max_workers=2, thread_name_prefix="worker-net")
        self.loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker-weights")
        self.loading: Future[Loaded | None] | None = None
        self.catch_up = False
        self.submitting: Future | None = None
        self.next_lease: Future[tuple[Lease | None, WeightsInfo | None]] | None = None
        self.prefetched: Lease | None = None
        try:
            while not self.stop.is_set():
                if self.status_due():
                    self.log_status()
                try:
                    if not self.sync_weights():
                        continue
                    lease = self.take_lease()
                    if lease is None:  # the coordinator already waited LEASE_WAIT_SECONDS for room
                        if self.client.run_complete:
                            log.info("the run is complete (its trainer published its last version): exiting")
                            break
                        self.stop.wait(IDLE_SECONDS)
                        continue
                    self.next_lease = background.submit(self.ask_ahead, self.lease_request())
                    played = self.generate(lease)
                    if played is None:  # a stage holder of its route failed: the lease is given up
                        continue
                    rollouts, generate_s = played
                    if not rollouts:  # a served task whose every episode failed: nothing to send
                        continue
                    try:  # one in flight, in order; the previous one's rejection is raised here
                        self.finish_submission()
                    finally:  # and this lease's work is sent all the same
                        self.submitting = background.submit(self.submit, lease, rollouts, generate_s)
                except RequestRejected as exc:
                    if self.on_rejected(exc) >= MAX_CONSECUTIVE_REJECTIONS:
                        log.error(
                            "stopping after %d consecutive rejections (last: %s)",
                            self.consecutive_rejections,
                            exc,
                        )
                        return 2
            try:
                self.finish_submission()
            except RequestRejected as exc:
                self.on_rejected(exc)
        finally:
            background.shutdown(wait=True, cancel_futures=True)
            self.loader.shutdown(wait=True, cancel_futures=True)
        log.info(
            "stopped: %d submissions, %d rollouts, %d tokens, %d retries, rejections %s",
            self.num_submissions,
            self.num_rollouts,
            self.num_tokens,
            self.client.retries,
            dict(self.rejections),
        )
        return 0

    def log_status(self) -> None:
        log.info(
            "status: %s, %d submissions, %d rollouts accepted, %d tokens, rejections %s%s",
            f"v{self.engine.policy_version}" if self.engine.policy_version >= 0 else "no weights yet",
            self.num_submissions,
            self.num_rollouts,
            self.num_tokens,
            dict(self.rejections),
            "; idle: the coordinator is waiting for a role (above)" if self.client.waiting else "",
        )

    def lease_request(self) -> LeaseRequest:
        return LeaseRequest(
            policy_version=self.engine.policy_version,
            max_groups=self.config.groups_per_lease,
            weights_received=self.weights.take_received(),
            wait_seconds=LEASE_WAIT_SECONDS,
            stage=0 if isinstance(self.engine, PipelineEngine) else None,
            # Taken between generations (the loop's thread generates too); lost if the request is.
            hop_timings=self.engine.hop_timer.take() if isinstance(self.engine, PipelineEngine) else [],
        )

    def ask_ahead(self, request: LeaseRequest) -> tuple[Lease | None, WeightsInfo | None]:
        """During a generation: the next lease, then the latest version (asked after the lease, so
        the worker never loads a version older than the one the lease was checked against)."""
        lease = self.client.lease(request)
        return lease, self.client.latest_weights()

    def take_lease(self) -> Lease | None:
        """The lease requested during the last generation, else one requested now."""
        lease, self.prefetched = self.prefetched, None
        if lease is not None and lease.deadline_unix - time.time() > LEASE_MARGIN_SECONDS:
            return lease
        return self.client.lease(self.lease_request())

    def finish_submission(self) -> None:
        submitting, self.submitting = self.submitting, None
        if submitting is not None:
            submitting.result()
            self.consecutive_rejections = 0  # only an accepted submission ends a run of rejections

    def sync_weights(self) -> bool:
        """Between generations: copy a finished background fetch into the engine, and start fetching
        the latest version (asked with the next lease when there is one) when behind. Blocks only
        for the first version and to catch up after a stale rejection; False (after a wait) while
        none can be loaded."""
        latest = None
        ahead, self.next_lease = self.next_lease, None
        if ahead is not None:  # a rejection of it is handled by the loop like any other
            self.prefetched, latest = ahead.result()
        catch_up, self.catch_up = self.catch_up, False
        if self.loading is not None and (catch_up or self.loading.done()):
            loading, self.loading = self.loading, None
            loaded = loading.result()
            if loaded is not None:
                self.weights.apply(loaded)
        if self.engine.policy_version < 0 or catch_up:
            return self.weights.follow(self.stop, latest)
        latest = latest or self.client.latest_weights()
        if self.loading is None and latest is not None and latest.version > self.engine.policy_version:
            self.loading = self.loader.submit(self.weights.fetch, latest)
        return True

    def generate(self, lease: Lease) -> tuple[list, float] | None:
        """Play every slot of the lease (one batch per turn); returns the rollouts and the seconds,
        or None when a stage holder of a routed lease failed (reported; the lease is re-leased)."""
        started = time.perf_counter()
        if isinstance(self.engine, PipelineEngine):
            try:
                self.engine.bind(lease)
                rollouts = self.player.play(self.engine, lease, seed=lease_seed(lease.lease_id))
                for rollout in rollouts:
                    attach_traces(self.engine, rollout)
            except HopFailed as exc:
                self.hops_failed[exc.reason] += 1
                log.warning("lease %s given up: %s", lease.lease_id, exc)
                report = StageReport(
                    lease_id=lease.lease_id,
                    stage=exc.hop.stage,
                    worker_id=exc.hop.worker_id,
                    reason=exc.reason,
                    detail=exc.detail[:200],
                )
                try:
                    self.client.report_stage(report)
                except RequestRejected as rejected:  # the lease expired meanwhile: nothing to free
                    log.info("hop report refused: %s", rejected)
                return None
            except VersionGone as exc:  # nothing a holder did: the lease runs out by its deadline
                log.warning("lease %s given up: %s", lease.lease_id, exc)
                return None
        else:
            rollouts = self.player.play(self.engine, lease, seed=lease_seed(lease.lease_id))
        return rollouts, time.perf_counter() - started

    def submit(self, lease: Lease, rollouts: list, generate_s: float) -> None:
        model_segments = [s for r in rollouts for s in r.segments if s.source == "model"]
        if self.config.delay_seconds:
            time.sleep(self.config.delay_seconds)  # simulated slow link; part of the step, not interrupted
        result = self.client.submit_rollouts(RolloutSubmission(rollouts=rollouts))
        tokens = sum(len(s.token_ids) for s in model_segments)
        self.num_submissions += 1
        self.num_rollouts += len(result.accepted)
        self.num_tokens += tokens
        versions = sorted({v for s in model_segments for v in s.policy_versions or []})
        log.info(
            "lease %s: %d groups, %d rollouts (%d accepted), %d tokens, %.0f tok/s, v%s, %d groups completed",
            lease.lease_id,
            len(lease.tasks),
            len(rollouts),
            len(result.accepted),
            tokens,
            tokens / max(generate_s, 1e-9),
            ",".join(map(str, versions)),
            result.groups_completed,
        )

    def on_rejected(self, exc: RequestRejected) -> int:
        """Log and count a rejection, react to it, and return the consecutive count."""
        self.rejections[exc.status] += 1
        self.consecutive_rejections += 1
        if exc.status == 410:
            log.warning("lease expired before submission; work dropped (%s)", exc.detail)
        elif exc.status == 409:
            log.warning("stale or duplicate (%s); resyncing weights", exc.detail)
            self.catch_up = True
        elif exc.status == 401:  # the client registered again and was refused anyway
            log.warning("credentials refused after registering again (%s)", exc.detail)
        else:
            log.warning("request rejected: %s", exc)
        return self.consecutive_rejections
