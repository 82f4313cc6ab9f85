"""Colocated rollouts: the trainer samples groups itself, with the weights it just published.

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

The engine holds a copy of the policy as *published*: the outbox hands it each version once its
publication is done (`published`), and it is copied in between two generations. A rollout thus
never claims a version the coordinator does not hold (a checkpoint could still lose an
unpublished one), and it is sampled from the very weights a worker would have at that version.
One round is played before the first batch is taken, so the trainer trains on the round before
while the coordinator scores the last one: local rollouts are trained one or two versions after
they were sampled (`max_staleness` must allow 2).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
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
from decentrl.protocol import LeaseRequest, RolloutSubmission, ServerInfo

log = logging.getLogger(__name__)


@dataclass
class RoundStats:
    """What the local rounds did since the last `take_stats`."""

    rollouts: int = 0
    seconds: float = 0.0
    """Spent sampling (the trainer's main thread)."""
    no_room: int = 0
    """Rounds that found no room under `max_pending_groups` (workers filled it)."""
    refused: list[str] = field(default_factory=list)


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
        self.lock = threading.Lock()
        self.offered: tuple[int, dict[str, torch.Tensor]] | None = None
        """The last published version and its state, not yet copied into the engine."""
        self.submitter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-local-submit")
        self.submitting: Future | None = None
        self.stats = RoundStats()

    def published(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """`version` is published with `state` (its full published tensors, not shared with the
        live model): the engine takes it before its next round. Called by the outbox's thread."""
        with self.lock:
            if self.offered is None or version > self.offered[0]:
                self.offered = (version, state)

    def _apply(self) -> None:
        with self.lock:
            offered, self.offered = self.offered, None
        if offered is None:
            return
        version, state = offered
        first = self.engine.policy_version < 0
        if self.merge:
            # Under LoRA only adapted layers change: after the first load, only they are merged.
            changed = None if first else [name for name in state if name.endswith(lora.ADAPTER_SUFFIXES)]
            state = lora.merge(state, changed)
        if first:
            self.engine.load_weights(state, version)
        else:
            self.engine.update_weights(state, version)

    def play_round(self) -> None:
        """Lease up to `groups` groups at the engine's version, sample them and hand them to the
        submitting thread (one submission in flight). A refused submission (its lease expired,
        say) is logged and counted: its slots are leased again."""
        self._finish()
        self._apply()
        if self.stop.is_set() or self.engine.policy_version < 0:
            return
        request = LeaseRequest(policy_version=self.engine.policy_version, max_groups=self.groups)
        lease = self.client.local_lease(request)
        if lease is None:
            self.stats.no_room += 1
            return
        started = time.perf_counter()
        rollouts = self.player.play(self.engine, lease, seed=lease_seed(lease.lease_id))
        self.stats.seconds += time.perf_counter() - started
        self.stats.rollouts += len(rollouts)
        self.submitting = self.submitter.submit(
            self.client.submit_local_rollouts, RolloutSubmission(rollouts=rollouts)
        )

    def _finish(self) -> None:
        submitting, self.submitting = self.submitting, None
        if submitting is None:
            return
        try:
            submitting.result()
        except RequestRejected as exc:
            log.warning("the coordinator refused a local round (its slots are leased again): %s", exc)
            self.stats.refused.append(exc.detail)

    def take_metrics(self) -> dict[str, float]:
        """The rounds since the last call, as step metrics."""
        stats, self.stats = self.stats, RoundStats()
        return {
            "local_rollouts": float(stats.rollouts),
            "local_sample_seconds": stats.seconds,
            "local_rounds_without_room": float(stats.no_room),
            "local_rounds_refused": float(len(stats.refused)),
        }

    def close(self) -> None:
        """Wait for the submission in flight (its rollouts are committed or refused), then stop."""
        try:
            self._finish()
        finally:
            self.submitter.shutdown(wait=True)
            self.client.close()
