"""Colocated rollouts: the trainer samples groups itself, with the weights it has just trained.

With `trainer.local_groups > 0` the trainer plays one round before each version: it leases up to
that many groups from the coordinator (`POST /v1/trainer/leases`, its token), samples them on an
engine in its own process, and submits them (`POST /v1/trainer/rollouts`) in a background thread
while it trains. The coordinator treats them as any worker's rollouts from there on: bound to
their lease, replayed, rewarded by its rubric, grouped, batched and counted in the staleness
statistics (`coordinator/http/trainer_rollouts.py`), so advantages, the batch contract and
durability do not change (a 2xx means committed; a round lost in a crash is an expired lease whose
slots are leased again). What the mode saves is what a trusted sampler in the trainer's process
does not need: no weight download, no signature checks, no sampled verification, and one lease
and one submission per round instead of a worker's traffic.

The engine samples with the version the trainer has just trained, copied in as it is handed to
the outbox (the state the outbox publishes, cast to the inference dtype), and a round is
submitted only once that version is published: a rollout never reaches the coordinator before
the version it claims (the coordinator refuses those), and a round sampled from a version that a
crash loses before its publication never leaves the process (its lease expires, its slots are
leased again). One round is played before each batch is taken, so the trainer trains on the
round before while the coordinator scores the last one: a colocated trainer alone trains its own
rollouts one version after they were sampled. The submitting thread also asks for the next
round's lease, so the trainer's own thread only samples and trains; with the batch it trains, the
next one fetched and the last one until its ack, the round ahead needs `max_pending_groups >=
3 x groups_per_step + local_groups` (`config/checks.py`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from decentrl.client import CoordinatorClient, RequestRejected
from decentrl.engines.hf import HFEngine
from decentrl.envs.chat import ChatFormat
from decentrl.envs.player import Player, lease_seed
from decentrl.model import lora
from decentrl.model.precision import Precision
from decentrl.protocol import Lease, LeaseRequest, RolloutSubmission, ServerInfo

log = logging.getLogger(__name__)

LEASE_MARGIN_S = 2.0
"""A lease asked ahead this close to its deadline is left to expire and a fresh one asked."""


@dataclass
class RoundStats:
    """What the local rounds did since the last `take_metrics`."""

    rollouts: int = 0
    seconds: float = 0.0
    """Spent sampling (the trainer's main thread)."""
    no_room: int = 0
    """Rounds that found no room under `max_pending_groups` (workers filled it)."""
    refused: int = 0


class LocalRollouts:
    def __init__(
        self,
        groups: int,
        info: ServerInfo,
        model_dir: Path,
        chat: ChatFormat,
        client: CoordinatorClient,
        precision: Precision,
        stop: threading.Event,
    ) -> None:
        self.groups = groups
        self.client = client
        self.stop = stop
        # The architecture only: the first published state (complete) replaces every weight.
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=precision.dtype)
        self.engine = HFEngine(
            cast(PreTrainedModel, model),
            info.eos_token_ids,
            info.pad_token_id,
            device=str(precision.device),
        )
        # Merged adapters (W0 + B @ A) run one product per layer instead of three; only a float32
        # engine keeps a small update that way: bf16 would round most of it back to W0, so there
        # the adapters are served unmerged, as a bf16 worker's engine does (model/adapters.py).
        self.merge = precision.dtype == torch.float32
        self.player = Player(chat, info.env_args)
        self.lock = threading.Condition()
        self.offered: tuple[int, dict[str, torch.Tensor]] | None = None
        """The last trained version and its state, not yet copied into the engine."""
        self.published_version = -1
        self.closing = False
        self.submitter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-local-submit")
        self.submitting: list[Future] = []
        """Rounds handed to the submitting thread (which sends them in order), not yet collected."""
        self.ahead: Lease | None = None
        """The next round's lease, asked by the submitting thread while a round waits to go out."""
        self.stats = RoundStats()

    def offer(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """`version` is trained and `state` is what will be published (the full tensors in the
        inference dtype, not shared with the live model): the next round samples from it."""
        with self.lock:
            if self.offered is None or version > self.offered[0]:
                self.offered = (version, state)

    def published(self, version: int) -> None:
        """`version` is published (called by the outbox's publishing thread)."""
        with self.lock:
            self.published_version = max(self.published_version, version)
            self.lock.notify_all()

    def _apply(self) -> None:
        with self.lock:
            offered, self.offered = self.offered, None
        if offered is None:
            return
        version, state = offered
        first = self.engine.policy_version < 0
        if self.merge:
            # Under LoRA only the adapted layers change: after the first load only they are merged
            # and copied (full-parameter training changes, and copies, every tensor).
            adapters = [name for name in state if name.endswith(lora.ADAPTER_SUFFIXES)]
            state = lora.merge(state, None if first or not adapters else adapters)
        if first:
            self.engine.load_weights(state, version)
        else:
            self.engine.update_weights(state, version)

    def _submit(self, version: int, submission: RolloutSubmission) -> None:
        """Ask for the next round's lease (off the trainer's critical path), then send this round
        once `version` is published; a round whose version never is published (the trainer stops
        first) is dropped: its lease expires."""
        with self.lock:
            held = self.published_version
        try:
            self.ahead = self.client.local_lease(
                LeaseRequest(policy_version=max(held, 0), max_groups=self.groups)
            )
        except RequestRejected as exc:  # the next round asks again, on its own time
            log.info("the lease asked ahead was refused: %s", exc)
        with self.lock:
            while self.published_version < version:
                if self.closing:
                    return
                self.lock.wait(0.5)
        self.client.submit_local_rollouts(submission)

    def _lease(self) -> Lease | None:
        """The lease asked ahead, unless it is near its deadline or there was no room then."""
        lease, self.ahead = self.ahead, None
        if lease is not None and lease.deadline_unix - time.time() > LEASE_MARGIN_S:
            return lease
        with self.lock:  # the lease is checked against a version the coordinator holds
            held = min(self.published_version, self.engine.policy_version)
        return self.client.local_lease(LeaseRequest(policy_version=max(held, 0), max_groups=self.groups))

    def play_round(self) -> None:
        """Lease up to `groups` groups at the engine's version, sample them and hand them to the
        submitting thread, which sends rounds in order while the trainer goes on. A refused
        submission (its lease expired, say) is logged and counted: its slots are leased again."""
        self._collect(wait=False)
        self._apply()
        if self.stop.is_set() or self.engine.policy_version < 0:
            return
        lease = self._lease()
        if lease is None:
            self.stats.no_room += 1
            return
        started = time.perf_counter()
        rollouts = self.player.play(self.engine, lease, seed=lease_seed(lease.lease_id))
        self.stats.seconds += time.perf_counter() - started
        self.stats.rollouts += len(rollouts)
        submission = RolloutSubmission(rollouts=rollouts)
        self.submitting.append(self.submitter.submit(self._submit, self.engine.policy_version, submission))

    def _collect(self, wait: bool) -> None:
        """The outcome of every round sent (all of them with `wait`, else those done); a failure
        other than a refusal is raised."""
        pending = []
        for future in self.submitting:
            if not wait and not future.done():
                pending.append(future)
                continue
            try:
                future.result()
            except RequestRejected as exc:
                log.warning("the coordinator refused a local round (its slots are leased again): %s", exc)
                self.stats.refused += 1
        self.submitting = pending

    def take_metrics(self) -> dict[str, float]:
        """The rounds since the last call, as step metrics."""
        stats, self.stats = self.stats, RoundStats()
        return {
            "local_rollouts": float(stats.rollouts),
            "local_sample_seconds": stats.seconds,
            "local_rounds_without_room": float(stats.no_room),
            "local_rounds_refused": float(stats.refused),
        }

    def close(self) -> None:
        """Finish the rounds in flight (committed or refused; dropped if their version was never
        published), then stop."""
        with self.lock:
            self.closing = True
            self.lock.notify_all()
        try:
            self._collect(wait=True)
        finally:
            self.submitter.shutdown(wait=True)
            self.client.close()
