"""The trainer role on N ranks under `torchrun`: the same story as `loop.py`, with the policy sharded.

Rank 0 is the only client of the coordinator: it pulls a batch, broadcasts it, and after the
collective step (each rank trains on its slice of the rows, gradients summed by FSDP2) it
publishes the gathered weights through the same signed-delta path and acks the batch. Every rank
writes its shards of the checkpoint (torch.distributed.checkpoint) before that, so a crash of any
rank, followed by `torchrun` restarting the group, resumes at the last checkpointed version,
re-publishes it (idempotent) and acks its batch: versions stay contiguous and no acked batch is
trained again. Rank 0 acks version v's batch (retrying until the coordinator answers) before v+1
trains, so no checkpoint is ever written while an earlier batch's ack is unconfirmed (unlike the
1-process trainer's outbox, `TrainerState.unacked` stays empty here) and no batch is trained twice.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from decentrl.algo.aggregation import BatchCounts
from decentrl.client import CoordinatorClient
from decentrl.config import ConfigError, RunConfig, TrainerConfig, check_ranks
from decentrl.engines.hf import HFEngine
from decentrl.envs import environment_from_config
from decentrl.envs.chat import ChatFormat
from decentrl.eval.evaluate import evaluate
from decentrl.model import lora
from decentrl.model.precision import Precision
from decentrl.protocol import BatchAck, BatchRequest, ServerInfo, StepMetrics, TrainGroup
from decentrl.trainer import distributed
from decentrl.trainer.batch import collate, version_schedule
from decentrl.trainer.checkpoint import TrainerState
from decentrl.trainer.distributed import Ranks
from decentrl.trainer.loop import within_staleness
from decentrl.trainer.outbox import next_batch
from decentrl.trainer.precision import MasterWeights
from decentrl.trainer.sharded_checkpoint import ShardedCheckpointer
from decentrl.trainer.step import (
    Algorithm,
    apply_correction,
    learning_rate,
    minibatch_update,
    score,
    staleness_stats,
)
from decentrl.weights.codec import DTYPES
from decentrl.weights.publisher import Publisher
from decentrl.weights.snapshot import state_for_publication

log = logging.getLogger(__name__)

IDLE_BROADCAST_S = 60.0
"""Rank 0 tells the other ranks it is still waiting at least this often (well inside the timeout)."""


@dataclass
class Work:
    """What rank 0 broadcasts each round: a batch to train on, or (batch_id None) keep waiting."""

    batch_id: str | None = None
    groups: list[TrainGroup] = field(default_factory=list)
    snapshot: bool = False
    groups_expired: int = 0


def sharded_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    master: MasterWeights,
    groups: list[TrainGroup],
    algorithm: Algorithm,
    config: TrainerConfig,
    info: ServerInfo,
    policy_version: int,
    ranks: Ranks,
    reference_model: torch.nn.Module | None = None,
) -> dict[str, float]:
    """One version on N ranks, the story of `step.train_step`: every rank collates the whole batch
    (advantages and the loss's denominators are global), scores pi_prox on its own rows, the rows
    are summed into the whole batch's pi_prox on every rank and the correction is applied to the
    whole batch (batch-global corrections see every token); then each mini-batch is split over the
    ranks, each rank's loss divided by the mini-batch's counts, and FSDP2 sums the gradients.
    `master` must have been built right after sharding: FSDP2 leaves the root's parameters
    unsharded after a forward, and the optimizer and the gradient norm need the sharded ones.
    A collective; returns the version's metrics (batch-level ones over the whole batch)."""
    max_new_tokens = info.sampling.max_new_tokens
    temperature = info.sampling.temperature

    def shaping(rewards_b: torch.Tensor, lengths_b: torch.Tensor) -> torch.Tensor:
        return algorithm.loss.shape_rewards(rewards_b, lengths_b, max_new_tokens)

    started = time.perf_counter()
    batch = collate(groups, info.pad_token_id, algorithm.advantage, shaping)
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(config, policy_version)
    # Every rank must run the same number of forward/backward passes (each is a collective under
    # FSDP2): a rank's share of a pass is one micro-batch (trainer.micro_batch_tokens does not split it).
    one_pass = config.model_copy(update={"micro_batch_tokens": 2**62})
    mine = [int(row) for row in torch.arange(batch.num_rows)[distributed.row_slice(batch.num_rows, ranks)]]
    kl_reference = reference_model if algorithm.config.kl_coef > 0 else None
    proximal_bt, reference_bt = score(
        model, batch, temperature, one_pass.micro_batch_tokens, kl_reference, mine
    )
    proximal_bt = distributed.sum_rows(proximal_bt, ranks)
    reference_bt = None if reference_bt is None else distributed.sum_rows(reference_bt, ranks)
    metrics = apply_correction(batch, proximal_bt, reference_bt, algorithm)
    per_minibatch: dict[str, list[float]] = defaultdict(list)
    for rows in version_schedule(
        batch.num_rows, num_minibatches(config, batch.num_rows, ranks), config.epochs
    ):
        minibatch = batch.select(rows)
        counts = BatchCounts(
            num_loss_tokens=minibatch.num_loss_tokens,
            num_sequences=minibatch.num_rows,
            max_new_tokens=max_new_tokens,
        )
        share = rows[distributed.row_slice(len(rows), ranks)]
        stats = minibatch_update(
            model, optimizer, master, batch.select(share), algorithm, one_pass, temperature, counts
        )
        for key, value in distributed.reduce_metrics(stats, ranks).items():
            per_minibatch[key].append(value)
    metrics.update({key: sum(values) / len(values) for key, values in per_minibatch.items()})
    metrics.update(staleness_stats(batch, policy_version))
    metrics["step_seconds"] = time.perf_counter() - started
    metrics["lr"] = optimizer.param_groups[0]["lr"]
    metrics["reward_mean"] = float(batch.rewards_b.mean())
    metrics["num_loss_tokens"] = float(batch.num_loss_tokens)
    metrics["num_rollouts"] = float(batch.num_rows)
    metrics["num_minibatches"] = float(len(per_minibatch["grad_norm"]))
    metrics["accuracy"] = float((batch.rewards_b == 1.0).float().mean())
    return metrics


def num_minibatches(config: TrainerConfig, num_rows: int, ranks: Ranks) -> int:
    """`config.minibatches_per_version`, or fewer when a mini-batch would leave a rank without a
    row (every rank's forward and backward are collectives). The sizes are checked when the
    trainer starts (`check_ranks`), so only a batch the staleness bound shrank takes fewer."""
    fitting = min(config.minibatches_per_version, num_rows // ranks.world_size)
    if fitting < config.minibatches_per_version and ranks.is_main:
        log.warning(
            "%d sequences over %d ranks: %d mini-batches this version instead of %d",
            num_rows,
            ranks.world_size,
            fitting,
            config.minibatches_per_version,
        )
    return fitting


class DistributedTrainer:
    def __init__(
        self, config: RunConfig, model_dir: Path, run_dir: Path, stop: threading.Event, ranks: Ranks
    ):
        self.config = config
        self.train = config.trainer
        self.stop = stop
        self.ranks = ranks
        torch.set_num_threads(self.train.num_threads)
        if (run_dir / "trainer" / "latest" / "state.json").is_file():
            raise ConfigError(
                f"{run_dir / 'trainer'} holds a 1-process checkpoint; resume this run with trainer.nproc=1 "
                "(without torchrun) or start a new run directory"
            )
        self.client = (
            CoordinatorClient(self.train.coordinator_url, self.train.token, interrupt=stop)
            if ranks.is_main
            else None
        )
        self.info = distributed.broadcast(self.client.info() if self.client else None, ranks)
        # Before loading anything: a mini-batch must give every rank a row (the run's own sizes).
        check_ranks(self.train, self.info.group_size, ranks.world_size)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if self.train.gradient_checkpointing:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # fp32 parameters: on CUDA FSDP2 computes in bf16 and keeps these as the master weights.
        self.model = lora.attach(base, config.lora)
        # Names as published, taken before sharding: a tied head shares the embedding's storage.
        self.publish_names = list(state_for_publication(self.model))
        distributed.shard_model(self.model, ranks.device)
        # Before any forward: the sharded parameters (DTensors) are what the optimizer steps.
        self.master = MasterWeights(self.model)
        self.optimizer = torch.optim.AdamW(
            self.master.parameters(),
            lr=self.train.lr,
            weight_decay=self.train.weight_decay,
        )
        self.algorithm = Algorithm.from_config(config.algorithm)
        self.reference_model = (
            lora.reference_model(
                self.model,
                lambda: distributed.shard_model(
                    AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), ranks.device
                ),
            )
            if config.algorithm.kl_coef > 0
            else None
        )
        self.checkpointer = ShardedCheckpointer(run_dir / "trainer" / "sharded", ranks)
        self.state = TrainerState(policy_version=0, batch_id=None)
        self.published: dict[str, torch.Tensor] = {}
        """Rank 0: the last published state (evaluation merges it into a plain model)."""
        self.delta_ratio: float | None = None
        if ranks.is_main:
            self.env = environment_from_config(config.task)
            self.chat = ChatFormat.from_model_dir(model_dir, self.info.eos_token_ids)
            # Evaluation in the trainer's dtype on this rank's device (Precision.for_evaluation).
            precision = Precision.from_config(self.train, str(ranks.device))
            plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=precision.dtype)
            self.eval_engine = HFEngine(
                plain, self.info.eos_token_ids, self.info.pad_token_id, device=str(precision.device)
            )
            self.publisher = Publisher(self.client, config.weights, run_dir / "trainer" / "signing_key.pem")
            self.publisher.register()

    def resume_or_start(self) -> None:
        if self.checkpointer.exists():
            self.state = self.checkpointer.load(self.model, self.optimizer)
            log.info("rank %d resumed at version %d", self.ranks.rank, self.state.policy_version)
        else:
            self.checkpointer.save(self.model, self.optimizer, self.state)
        self.publish_and_ack()

    def publish_and_ack(self, snapshot: bool = False) -> None:
        """Collective gather, then rank 0 publishes (idempotent) and acks, as in `loop.py`."""
        state = distributed.full_state(self.model, self.publish_names, self.ranks)
        if not self.ranks.is_main:
            return
        if self.config.lora.rank > 0:
            state = lora.publication_layout(state, self.config.lora.alpha / self.config.lora.rank)
        self.published = state
        published = self.publisher.publish_state(state, self.state.policy_version, snapshot)
        state_bytes = sum(t.numel() for t in state.values()) * DTYPES[self.config.weights.dtype].itemsize
        deltas = [done.payload_bytes for done in published if done.kind == "delta"]
        self.delta_ratio = deltas[0] / state_bytes if deltas else None
        for done in published:
            log.info("published v%d %s (%d bytes)", done.version, done.kind, done.payload_bytes)
        if self.state.batch_id is not None:
            self.client.ack_batch(self.state.batch_id, BatchAck(policy_version=self.state.policy_version))

    def next_work(self) -> Work | None:
        """Collective: rank 0's next batch (None: stop) on every rank."""
        work: Work | None = None
        if self.ranks.is_main and self.state.policy_version < self.train.num_steps and not self.stop.is_set():
            work = self._pull()
        return distributed.broadcast(work, self.ranks)

    def _pull(self) -> Work | None:
        """Rank 0: a batch within the staleness bound, a Work without one after IDLE_BROADCAST_S."""
        request = BatchRequest(
            policy_version=self.state.policy_version,
            max_groups=self.train.groups_per_step,
            drop_zero_variance=self.algorithm.loss.filters_groups,
        )
        deadline = time.monotonic() + IDLE_BROADCAST_S
        while not self.stop.is_set():
            batch = next_batch(self.client, request)
            if batch is not None:
                groups = within_staleness(batch.groups, self.state.policy_version, self.info.max_staleness)
                if groups:
                    expired = batch.num_groups_expired + len(batch.groups) - len(groups)
                    return Work(batch.batch_id, groups, batch.snapshot_requested, expired)
                log.warning("batch %s: every group exceeds max_staleness; acked untrained", batch.batch_id)
                self.client.ack_batch(batch.batch_id, BatchAck(policy_version=self.state.policy_version))
            if time.monotonic() > deadline:
                return Work()
            time.sleep(self.train.poll_seconds)
        return None

    def run(self) -> int:
        run_started = time.monotonic()
        self.resume_or_start()
        if self.ranks.is_main and self.state.policy_version == 0 and self.train.eval_every:
            self.report_base_evaluation()  # as the one-process trainer does; the other ranks wait
        while (work := self.next_work()) is not None:
            if work.batch_id is None:
                continue
            metrics = sharded_step(
                self.model,
                self.optimizer,
                self.master,
                work.groups,
                self.algorithm,
                self.train,
                self.info,
                self.state.policy_version,
                self.ranks,
                self.reference_model,
            )
            self.state = TrainerState(policy_version=self.state.policy_version + 1, batch_id=work.batch_id)
            self.checkpointer.save(self.model, self.optimizer, self.state)
            self.publish_and_ack(snapshot=work.snapshot)
            if self.ranks.is_main:
                self.report(metrics, work, time.monotonic() - run_started)
        return 0

    def report(self, metrics: dict[str, float], work: Work, elapsed: float) -> None:
        version = self.state.policy_version
        metrics["elapsed_seconds"] = elapsed
        metrics["groups_expired"] = float(work.groups_expired)
        metrics["num_ranks"] = float(self.ranks.world_size)
        if self.delta_ratio is not None:
            metrics["weights_delta_ratio"] = self.delta_ratio
        if self.train.eval_every and version % self.train.eval_every == 0:
            metrics["eval_accuracy"] = self.evaluate(version)
        for alarm in self.client.post_metrics(StepMetrics(policy_version=version, metrics=metrics)):
            log.warning("v%d reward alarm: %s", version, alarm)
        log.info(
            "v%d from batch %s: reward %.3f staleness %.2f loss %.4f (%d ranks)",
            version,
            work.batch_id,
            metrics["reward_mean"],
            metrics["staleness_mean"],
            metrics["loss"],
            self.ranks.world_size,
        )

    def evaluate(self, version: int) -> float:
        """Rank 0: held-out accuracy of the published `version`."""
        self.eval_engine.load_weights(self.published, version)
        sampling = self.info.sampling
        result = evaluate(
            self.eval_engine,
            self.env,
            self.chat,
            self.train.eval_size,
            sampling.max_new_tokens,
            max_context=sampling.max_context,
        )
        return result.accuracy

    def report_base_evaluation(self) -> None:
        """Rank 0: version 0's held-out accuracy, an evaluation-only step (see `loop.py`)."""
        accuracy = self.evaluate(0)
        self.client.post_metrics(StepMetrics(policy_version=0, metrics={"eval_accuracy": accuracy}))
        log.info(
            "v0 held-out accuracy %.3f (before training, %d problems, greedy)", accuracy, self.train.eval_size
        )


def main_distributed_trainer(config: RunConfig, model_dir: Path, run_dir: Path) -> int:
    """Entry of each rank under torchrun. SIGTERM/SIGINT: rank 0 finishes the current step
    (checkpointed and published) and tells the others to exit; all exit 0."""
    ranks = distributed.init_process_group()
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        log.info(
            "rank %d %s: finishing the current step, then exiting", ranks.rank, signal.Signals(signum).name
        )
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    trainer = DistributedTrainer(config, model_dir, run_dir, stop, ranks)
    clean = False
    try:
        code = trainer.run()
        clean = True
        return code
    finally:
        if trainer.client is not None:
            trainer.client.close()
        distributed.close_process_group(clean)
