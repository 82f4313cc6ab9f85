"""The worker loop: stay on the latest weights → lease → generate → submit, until stopped.

A worker must survive a bad answer: rejections are logged and counted, and only a long run of
consecutive ones (a misconfigured or banned worker) ends it with exit code 2.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from decentrl.client import CoordinatorClient, RequestRejected
from decentrl.config import WorkerConfig
from decentrl.engines.base import InferenceEngine
from decentrl.protocol import Lease, LeaseRequest, RolloutSubmission
from decentrl.worker.episodes import Player
from decentrl.worker.weights import WorkerWeights

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_REJECTIONS = 20
IDLE_MIN_SECONDS = 0.05
IDLE_MAX_SECONDS = 1.0


def lease_seed(lease_id: str) -> int:
    """Sampling seed derived from the lease id, so a lease's samples can be reproduced."""
    return int.from_bytes(hashlib.sha256(lease_id.encode()).digest()[:4], "big")


class Worker:
    def __init__(
        self,
        client: CoordinatorClient,
        engine: InferenceEngine,
        config: WorkerConfig,
        stop: threading.Event,
        reauthenticate: Callable[[], object],
        player: Player,
        weights: WorkerWeights,
    ):
        self.client = client
        self.engine = engine
        self.player = player
        self.config = config
        self.stop = stop
        self.reauthenticate = reauthenticate
        self.rejections: Counter[int] = Counter()
        self.consecutive_rejections = 0
        self.num_submissions = 0
        self.num_rollouts = 0
        self.num_tokens = 0
        self.weights = weights

    def run(self) -> int:
        """Exit code: 0 when stopped, 2 after too many consecutive rejections."""
        idle = IDLE_MIN_SECONDS
        while not self.stop.is_set():
            try:
                if not self.sync_weights():
                    continue
                lease = self.client.lease(
                    LeaseRequest(
                        policy_version=self.engine.policy_version,
                        max_groups=self.config.groups_per_lease,
                        weights_received=self.weights.take_received(),
                    )
                )
                if lease is None:
                    self.stop.wait(idle)
                    idle = min(IDLE_MAX_SECONDS, idle * 2)
                    continue
                idle = IDLE_MIN_SECONDS
                self.serve(lease)
                self.consecutive_rejections = 0
            except RequestRejected as exc:
                if self.on_rejected(exc) >= MAX_CONSECUTIVE_REJECTIONS:
                    log.error(
                        "stopping after %d consecutive rejections (last: %s)",
                        self.consecutive_rejections,
                        exc,
                    )
                    return 2
        log.info(
            "stopped: %d submissions, %d rollouts, %d tokens, %d retries, rejections %s",
            self.num_submissions,
            self.num_rollouts,
            self.num_tokens,
            self.client.retries,
            dict(self.rejections),
        )
        return 0

    def sync_weights(self) -> bool:
        """Load the latest published version when behind (worker/weights.py); False (after a wait)
        while none can be loaded."""
        return self.weights.follow(self.stop)

    def serve(self, lease: Lease) -> None:
        """Play every slot of the lease (one batch per turn) and submit them together."""
        started = time.perf_counter()
        rollouts = self.player.play(self.engine, lease, seed=lease_seed(lease.lease_id))
        generate_s = time.perf_counter() - started
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
        elif exc.status == 401:
            log.warning("credentials refused (%s); registering again", exc.detail)
            try:
                self.reauthenticate()
            except RequestRejected as again:
                log.warning("registration refused: %s", again)
        else:
            log.warning("request rejected: %s", exc)
        return self.consecutive_rejections
