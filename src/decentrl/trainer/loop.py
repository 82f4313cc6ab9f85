"""The trainer role: pull ready groups, update the policy, publish version v+1, repeat.

The loop reads as the story of one version: take a batch of groups (the next one is already
being fetched), re-check their staleness, compute advantages, score the batch under pi_prox, take
one AdamW step per mini-batch (trainer/step.py), checkpoint, and hand the new weights to the
outbox (trainer/outbox.py), which publishes them, acknowledges the batch and reports the metrics
(with, every `eval_every` versions, held-out greedy accuracy) while the next version trains.

One process or N ranks under `torchrun` (`trainer.nproc`), one code path: rank 0 alone owns the
coordinator's clients, the prefetch, the outbox, the publisher, the trackers, the rollout
inspector and evaluation, and hands each batch to every rank (`distributed.broadcast`, a no-op
for one process). On N ranks the policy is sharded with FSDP2, every rank writes its shards of
the checkpoint before the version goes out (torch.distributed.checkpoint; rank 0 first waits for
the previous version's publication, as the one-process outbox writes each checkpoint after the
previous publication), and rank 0 publishes the gathered weights. A crash of any rank, then
`torchrun` restarting the group, resumes at the last checkpointed version exactly as one process
does: it is re-published (idempotent), its batch and the unconfirmed earlier ones are acked, and
no acked batch is trained again.

K stage trainers (`trainer.pipeline_stages`, the pipeline dimension of `Ranks`) are the same loop:
rank s holds, trains, checkpoints, signs and publishes stage s alone (`stage_training.py`); each
version's passes run pipeline-parallel across the ranks (`pipeline_parallel.py`), and rank 0
acks a batch once every stage's manifest of its version is in.

`Trainer` is this loop. What each rank holds before its first version is set up by its base
`TrainerSetup` (`trainer_setup.py`); the publication, ack and reports of each version are
`TrainerPublication`'s (`publication.py`).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from decentrl.config import RunConfig
from decentrl.model.vision import drawn_images
from decentrl.protocol import BatchRequest, TrainGroup, VerifyJob, VerifyJobsRequest
from decentrl.trainer import distributed, pipeline_parallel
from decentrl.trainer.batch import collate, rollout_logprobs, within_staleness
from decentrl.trainer.checkpoint import TrainerState
from decentrl.trainer.outbox import Outbox, Prefetch, TrainedVersion
from decentrl.trainer.publication import TrainerPublication
from decentrl.trainer.step import train_step

log = logging.getLogger(__name__)

BATCH_WAIT_SECONDS = 1.0
"""With too few groups ready, the coordinator holds the batch request this long for more (a long
poll: the batch is answered as its last group is scored, not at the next poll)."""

VERIFY_POLL_S = 0.5
"""Stage trainers: while no batch is ready, rank 0 asks for verification jobs this often (a group
held for its verdict is a batch that waits for them)."""
VERIFY_JOBS = 64
LOCAL_CHECK_S = 1.0
"""A colocated trainer waiting for its batch checks this often that its sampler process still runs
(its rounds are the batch it waits for)."""
IDLE_BROADCAST_S = 60.0
"""On several ranks, rank 0 tells the others it is still waiting for a batch at least this often
(well inside `distributed.COLLECTIVE_TIMEOUT`)."""


@dataclass
class Work:
    """What rank 0 hands every rank each round: a batch to train on, or (batch_id None, several
    ranks only) keep waiting."""

    batch_id: str | None = None
    groups: list[TrainGroup] = field(default_factory=list)
    snapshot: bool = False
    """A worker asked for a full snapshot: this version's publication carries one."""
    groups_expired: int = 0
    verify_jobs: list[VerifyJob] = field(default_factory=list)
    """Stage trainers: sampled rollouts every stage checks on its own stage (`stage_verification.py`)."""


class Trainer(TrainerPublication):
    def run(self) -> int:
        run_started = time.monotonic()
        self.resume_or_start()
        self.first_version = self.state.policy_version  # the pace (ETA) is this process's own
        main = self.ranks.is_main
        if distributed.broadcast(self.report_run() if main else None, self.ranks):
            if main:
                log.info(self.complete_message())
            return 0
        outbox = None
        if main:
            outbox = Outbox(self.publish, self.acknowledge)
        elif self.stages is not None:  # publishes its stage; rank 0 acks
            outbox = Outbox(self.publish, lambda trained: None)
        prefetch = Prefetch(self.prefetch_client, self.stop, self.train.poll_seconds) if main else None
        try:
            if prefetch is not None:
                prefetch.start(self.batch_request(self.state.policy_version, held=[]))
                self.snapshots_before = self.snapshots_published
                if self.state.policy_version == 0 and self.train.eval_every:
                    self.report_base_evaluation()  # while the first batch is fetched (and scored)
            while (work := self.next_work(prefetch, outbox)) is not None:
                if work.verify_jobs and self.stages is not None:
                    self.stages.verify(work.verify_jobs, self.ranks, self.client)
                if work.batch_id is not None:
                    self.train_version(work, outbox, time.monotonic() - run_started)
            if outbox is not None:
                outbox.wait()
        finally:
            if outbox is not None:
                outbox.close()
            if prefetch is not None:
                prefetch.close()
        if main and self.state.policy_version >= self.train.num_steps and self.report_run():
            log.info(self.complete_message())
        return 0

    def resume_or_start(self) -> None:
        if self.checkpointer.exists():
            self.state = self.checkpointer.load(self.model, self.optimizer, self.master)
            log.info("rank %d resumed at version %d", self.ranks.rank, self.state.policy_version)
        else:
            self.checkpointer.save(self.model, self.optimizer, self.state, self.master)
        state = self.publication()
        if self.ranks.is_main:
            if self.local is not None:
                self.local.offer(self.state.policy_version, state)
            self.publish_and_ack(TrainedVersion(self.state.policy_version, self.state.batch_id or "", state))
        elif self.stages is not None:
            self.publish(TrainedVersion(self.state.policy_version, self.state.batch_id or "", state))

    def next_work(self, prefetch: Prefetch | None, outbox: Outbox | None) -> Work | None:
        """Rank 0's next batch on every rank (a collective on N ranks); None: stop."""
        work = self.take_work(prefetch, outbox) if prefetch is not None and outbox is not None else None
        return distributed.broadcast(work, self.ranks)

    def take_work(self, prefetch: Prefetch, outbox: Outbox) -> Work | None:
        """Rank 0: the next batch within the staleness bound, with the one after it requested (it
        is fetched while this one trains and its version goes out); on N ranks a Work without a
        batch after `IDLE_BROADCAST_S` of waiting; None once the run is done or stopping."""
        idle = IDLE_BROADCAST_S if self.ranks.sharded else VERIFY_POLL_S if self.stages is not None else None
        if self.local is not None:
            idle = min(idle or LOCAL_CHECK_S, LOCAL_CHECK_S)
        while self.state.policy_version < self.train.num_steps and not self.stop.is_set():
            if self.local is not None:
                self.local.check()
            try:
                batch = prefetch.take(idle)
            except TimeoutError:
                return Work(verify_jobs=self.verify_jobs())
            if batch is None:
                return None
            # A snapshot asked for before this batch was fetched and published since needs no other.
            snapshot = batch.snapshot_requested and self.snapshots_published == self.snapshots_before
            groups = within_staleness(batch.groups, self.state.policy_version, self.info.max_staleness)
            next_version = self.state.policy_version + (1 if groups else 0)
            if next_version < self.train.num_steps:  # no batch is asked for past the last version
                held = [*outbox.held(), batch.batch_id]
                prefetch.start(self.batch_request(next_version, held))
                self.snapshots_before = self.snapshots_published
            if groups:
                expired = batch.num_groups_expired + len(batch.groups) - len(groups)
                return Work(batch.batch_id, groups, snapshot, expired, self.verify_jobs())
            # The coordinator applies the same bound, so this means a version mix-up.
            log.warning("batch %s: every group exceeds max_staleness; acked untrained", batch.batch_id)
            outbox.put(TrainedVersion(self.state.policy_version, batch.batch_id, state=None))
        return None

    def batch_request(self, version: int, held: list[str]) -> BatchRequest:
        """A request for the batch that trains at `version` (its staleness is counted there)."""
        return BatchRequest(
            policy_version=version,
            max_groups=self.train.groups_per_step,
            drop_zero_variance=self.algorithm.loss.filters_groups,
            held=held,
            wait_seconds=BATCH_WAIT_SECONDS,
        )

    def verify_jobs(self) -> list[VerifyJob]:
        """Rank 0 of stage trainers: sampled rollouts waiting for their verdicts (none otherwise)."""
        if self.stages is None or self.client is None:
            return []
        request = VerifyJobsRequest(max_jobs=VERIFY_JOBS, dtype="float32")
        return self.client.verify_jobs(request).jobs

    def train_version(self, work: Work, outbox: Outbox | None, elapsed: float) -> None:
        """Train `work` into the next version, checkpoint it and (rank 0) hand it to the outbox."""
        metrics = self.step(work.groups)
        metrics["elapsed_seconds"] = elapsed  # since this process started
        metrics["groups_expired"] = float(work.groups_expired)
        if self.local is not None:
            metrics |= self.local.take_metrics()
        self.state = TrainerState(
            policy_version=self.state.policy_version + 1,
            batch_id=work.batch_id,
            unacked=outbox.unacked() if outbox is not None else [],
        )
        # One process: copied now, written by the outbox before the version goes out. N ranks:
        # written now by every rank, once the previous version is out. Either way a restart
        # re-publishes exactly the last version written, acks its batch and the earlier ones not
        # yet confirmed, and its batch's successors return.
        if (self.ranks.sharded or self.ranks.pipelined) and outbox is not None:
            outbox.wait_published()
        checkpoint = self.checkpointer.commit(self.model, self.optimizer, self.state, self.master)
        state = self.publication()
        if outbox is None:
            return
        version = self.state.policy_version
        if self.local is not None:  # the next round samples this version (sent once it is out)
            self.local.offer(version, state)
        trained = TrainedVersion(version, work.batch_id or "", state, work.snapshot, checkpoint)
        if self.train.eval_every and version % self.train.eval_every == 0:
            metrics["eval_accuracy"] = self.evaluate()
        if self.ranks.is_main:
            trained.report = self.reporter(trained, metrics, self.inspected)
        outbox.put(trained)

    def step(self, groups: list[TrainGroup]) -> dict[str, float]:
        """One version on `groups` (on N ranks a collective: every rank holds the whole batch)."""
        version = self.state.policy_version
        max_new_tokens = self.info.sampling.max_new_tokens

        def shaping(rewards_b: torch.Tensor, lengths_b: torch.Tensor) -> torch.Tensor:
            return self.algorithm.loss.shape_rewards(rewards_b, lengths_b, max_new_tokens)

        started = time.perf_counter()
        tensors = collate(
            groups, self.info.pad_token_id, self.algorithm.advantage, shaping, self.pixel_rows(groups)
        )
        args = (tensors, self.algorithm, self.train, self.info.sampling.temperature, version, max_new_tokens)
        if self.stages is not None:
            metrics = pipeline_parallel.train_step(self.stages.runner, self.optimizer, *args)
        else:
            metrics = train_step(
                self.model, self.optimizer, *args, self.reference_model, self.master, self.ranks
            )
        metrics["step_seconds"] = time.perf_counter() - started
        if self.ranks.is_main:
            self.inspected = rollout_logprobs(groups, tensors, self.config.monitor.inspect_rollouts)
        metrics["accuracy"] = float((tensors.rewards_b == 1.0).float().mean())
        return metrics

    def pixel_rows(self, groups: list[TrainGroup]) -> list[torch.Tensor] | None:
        """A vision-language policy: each rollout's images, drawn from its task's seed, as pixel
        values (in batch order); None for a text policy."""
        if self.pixels is None:
            return None
        rows = []
        for group in groups:
            for rollout in group.rollouts:
                images = drawn_images(self.env, group.seed, rollout.images)
                rows.append(self.pixels.pixel_values(images) if images else torch.zeros((0, 3, 1, 1)))
        return rows


def main_trainer(config: RunConfig, model_dir: Path, run_dir: Path, torchrun: bool = False) -> int:
    """CLI entry of one process, or (`torchrun`) of each rank under torchrun. SIGTERM/SIGINT:
    (rank 0) finish the current step, checkpointed and published, and (on N ranks) tell the
    others to stop; every process exits 0."""
    ranks = distributed.init_process_group(config.trainer.pipeline_stages) if torchrun else None
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        rank = "" if ranks is None else f"rank {ranks.rank} "
        log.info("%s%s: finishing the current step, then exiting", rank, signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    trainer, clean = None, False
    try:
        trainer = Trainer(config, model_dir, run_dir, stop, ranks)
        code = trainer.run()
        clean = True
        return code
    finally:
        if trainer is not None:
            trainer.close()
        if ranks is not None:
            distributed.close_process_group(clean)
