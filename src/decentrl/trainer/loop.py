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
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from transformers import PreTrainedModel

from decentrl.client import CoordinatorClient
from decentrl.config import ConfigError, RunConfig, adopt_coordinator_sections, check_ranks, shareable
from decentrl.engines.hf import HFEngine
from decentrl.envs import environment_from_config
from decentrl.envs.chat import ChatFormat
from decentrl.eval.evaluate import evaluate
from decentrl.model import lora
from decentrl.model.precision import Precision
from decentrl.model.vision import PixelInputs, drawn_images, load_policy
from decentrl.monitor.reporting import eta
from decentrl.monitor.trackers import open_trackers
from decentrl.protocol import (
    TRAINER_SECTIONS,
    BatchAck,
    BatchRequest,
    RolloutLogprobs,
    StepMetrics,
    TrainerRun,
    TrainGroup,
    VerifyJob,
    VerifyJobsRequest,
)
from decentrl.trainer import distributed, pipeline_parallel
from decentrl.trainer.batch import collate, rollout_logprobs, within_staleness
from decentrl.trainer.checkpoint import Checkpointer, TrainerState
from decentrl.trainer.distributed import Ranks
from decentrl.trainer.local_rollouts import LocalRollouts
from decentrl.trainer.master_weights import MasterWeights
from decentrl.trainer.outbox import Outbox, Prefetch, TrainedVersion
from decentrl.trainer.sharded_checkpoint import open_checkpointer
from decentrl.trainer.stage_training import StageTraining, wait_complete
from decentrl.trainer.step import Algorithm, train_step
from decentrl.weights.codec import published_state
from decentrl.weights.publisher import Publisher
from decentrl.weights.unique_storage import state_for_publication

log = logging.getLogger(__name__)

BATCH_WAIT_SECONDS = 1.0
"""With too few groups ready, the coordinator holds the batch request this long for more (a long
poll: the batch is answered as its last group is scored, not at the next poll)."""

VERIFY_POLL_S = 0.5
"""Stage trainers: while no batch is ready, rank 0 asks for verification jobs this often (a group
held for its verdict is a batch that waits for them)."""
VERIFY_JOBS = 64
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


class Trainer:
    def __init__(
        self,
        config: RunConfig,
        model_dir: Path,
        run_dir: Path,
        stop: threading.Event,
        ranks: Ranks | None = None,
    ):
        self.train = config.trainer
        self.stop = stop
        torch.set_num_threads(self.train.num_threads)
        self.precision = Precision.from_config(self.train, None if ranks is None else str(ranks.device))
        self.ranks = ranks = ranks or Ranks.one(self.precision.device)
        main = ranks.is_main
        self.client = (
            CoordinatorClient(self.train.coordinator_url, self.train.token, interrupt=stop) if main else None
        )
        self.info = distributed.broadcast(self.client.info() if self.client else None, ranks)
        # Train the coordinator's task (and refuse a config that names another one).
        config = self.config = adopt_coordinator_sections(config, self.info.sections, "trainer")
        if self.info.stage_keys is not None and not ranks.pipelined:
            raise ConfigError(
                "this run is trained by stage trainers, one per pipeline stage: start the trainer with "
                "--set trainer.pipeline_stages=K, K the run's model.num_stages"
            )
        if ranks.sharded:  # before loading anything: a mini-batch must give every rank a row
            check_ranks(self.train, self.info.group_size, ranks.world_size)
        self.stages = (
            StageTraining.open(config, self.info, model_dir, run_dir, ranks) if ranks.pipelined else None
        )
        self.checkpointer = open_checkpointer(run_dir / "trainer", ranks)
        self.env = environment_from_config(config.task, config.sandbox)
        self.pixels = PixelInputs.from_model_dir(model_dir)
        """A vision-language policy's image processor: the rows' images drawn from their seeds."""
        self.model = self.load_model(model_dir)
        # The optimizer steps fp32 tensors: the parameters themselves (on N ranks their sharded
        # DTensors, taken before any forward), or their master copies.
        self.master = MasterWeights(self.model)
        self.optimizer = torch.optim.AdamW(
            self.master.parameters(), lr=self.train.lr, weight_decay=self.train.weight_decay
        )
        self.algorithm = Algorithm.from_config(config.algorithm)
        # The KL reference is the frozen initial policy (the warm start), built only when used;
        # a LoRA run has it under its adapters.
        self.reference_model = (
            lora.reference_model(self.model, lambda: self.load_pretrained(model_dir, sharded=ranks.sharded))
            if config.algorithm.kl_coef > 0 and self.stages is None  # stage trainers: their runner's
            else None
        )
        self.state = TrainerState(policy_version=0, batch_id=None)
        self.snapshot_asked = False
        """A worker asked for a snapshot (heard with an ack): the next publication carries one."""
        self.snapshots_published = 0
        self.snapshots_before = 0
        """`snapshots_published` when the batch in flight was requested."""
        self.inspected: list[RolloutLogprobs] = []
        """The trainer's log-probs of a few rollouts of the last batch (for the dashboard)."""
        self.first_version = 0
        self.local: LocalRollouts | None = None
        self.evaluated: dict[str, torch.Tensor] = {}
        """N ranks: the last gathered weights, which rank 0's evaluation model loads."""
        if main:
            self.open_main(model_dir, run_dir)
        elif self.stages is not None:  # every stage trainer publishes its own stage
            self.open_publisher(run_dir)

    def open_main(self, model_dir: Path, run_dir: Path) -> None:
        """Rank 0's share: evaluation, the outbox's and prefetch's clients, the publisher, trackers."""
        config = self.config
        self.chat = ChatFormat.from_model_dir(model_dir, self.info.eos_token_ids)
        if self.stages is None:  # stage trainers never hold the whole model to evaluate
            # One process evaluates the live model (no copy: between steps, never during one; a
            # transformers model, possibly wrapped by peft, HFEngine needs only its forward). Rank 0
            # of N evaluates a plain model in the trainer's dtype loaded with the gathered weights.
            evaluated = (
                self.model if not self.ranks.sharded else self.load_pretrained(model_dir, sharded=False)
            )
            self.eval_engine = HFEngine(
                cast(PreTrainedModel, evaluated),
                self.info.eos_token_ids,
                self.info.pad_token_id,
                device=str(self.precision.device),
                pixels=self.pixels,
            )
        # Signed deltas in the inference dtype; the signing key stays in run_dir/trainer.
        # The outbox's two threads (publish; ack and metrics) and the prefetch of the next batch
        # each have a client.
        url, token = self.train.coordinator_url, self.train.token
        self.ack_client = CoordinatorClient(url, token, interrupt=self.stop)
        self.prefetch_client = CoordinatorClient(url, token, interrupt=self.stop)
        self.open_publisher(run_dir)
        self.trackers = open_trackers(config.monitor, run_dir, "trainer", shareable(config))
        if self.train.local_groups:  # colocated: the trainer's own rounds of rollouts
            client = CoordinatorClient(url, token, interrupt=self.stop)
            self.local = LocalRollouts(
                self.train.local_groups, self.info, model_dir, self.chat, client, self.precision, self.stop
            )

    def open_publisher(self, run_dir: Path) -> None:
        """Signed deltas in the inference dtype; the signing key stays in run_dir/trainer (a stage
        trainer's in its stage's directory there)."""
        self.outbox_client = CoordinatorClient(
            self.train.coordinator_url, self.train.token, interrupt=self.stop
        )
        if self.stages is not None:
            self.publisher = self.stages.publisher(self.outbox_client, self.config, self.info)
        else:
            self.publisher = Publisher(
                self.outbox_client,
                self.config.weights,
                run_dir / "trainer" / "signing_key.pem",
                self.info.stage_map,  # the coordinator's, which refuses manifests split otherwise
            )
        self.publisher.register()

    def load_pretrained(self, model_dir: Path, sharded: bool) -> torch.nn.Module:
        """The warm start: in the trainer's dtype on its device, or (`sharded`) fp32 sharded over
        the ranks (on CUDA FSDP2 computes in bf16 and keeps these as the master weights)."""
        if sharded:
            model = load_policy(model_dir, torch.float32)
            return distributed.shard_model(model, self.ranks.device)
        model = load_policy(model_dir, self.precision.dtype)
        # transformers wraps `to` in a decorator that pyright reads as an unbound function
        return model.to(self.precision.device).eval()  # pyright: ignore[reportArgumentType]

    def load_model(self, model_dir: Path) -> torch.nn.Module:
        """The policy with gradient checkpointing when asked and, with lora.rank > 0, adapters
        (then only they train and change between versions); on N ranks sharded by FSDP2."""
        if self.stages is not None:  # this rank's stage alone, fp32
            self.publish_names = list(self.stages.stage_model.state())
            return self.stages.stage_model.model
        sharded = self.ranks.sharded
        dtype = torch.float32 if sharded else self.precision.dtype
        model: Any = load_policy(model_dir, dtype)  # checkpointing, peft
        if self.train.gradient_checkpointing:
            # Non-reentrant checkpointing also works when the inputs need no gradient (LoRA).
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model = lora.attach(model, self.config.lora)
        # Names as published, taken before sharding: a tied head shares the embedding's storage.
        self.publish_names = list(state_for_publication(model))
        if sharded:
            distributed.shard_model(model, self.ranks.device)
        else:
            model = model.to(self.precision.device).eval()
        if self.ranks.is_main:
            log.info(
                "trainer on %d rank(s) on %s, parameters in %s%s",
                self.ranks.world_size,
                self.ranks.device,
                str(dtype).removeprefix("torch."),
                " with fp32 master weights" if dtype != torch.float32 else "",
            )
        return model

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

    def publication(self) -> dict[str, torch.Tensor]:
        """The weights to publish, copied (training goes on while the outbox encodes them): in
        the inference dtype off the live model, or on N ranks gathered to rank 0 (a collective;
        the other ranks get an empty dict); a stage trainer's, its stage's."""
        if self.stages is not None:
            return self.stages.publication(self.config.weights.dtype, self.state.policy_version)
        if not self.ranks.sharded:
            live = lora.publication_state(self.model)
            state = published_state(live, self.config.weights.dtype)
            return {
                name: tensor.clone() if tensor.data_ptr() == live[name].data_ptr() else tensor
                for name, tensor in state.items()
            }
        state = distributed.full_state(self.model, self.publish_names, self.ranks)
        if self.config.lora.rank > 0 and state:
            state = lora.publication_layout(state, self.config.lora.alpha / self.config.lora.rank)
        self.evaluated = state  # fp32, as trained: what rank 0 evaluates
        return state

    def publish_and_ack(self, trained: TrainedVersion) -> None:
        """Idempotent: a restart re-publishes the checkpointed version and acks its batch, and
        first the batches of earlier versions whose acks were still on their way at the crash
        (left unacked, the coordinator would hand them out again: trained twice)."""
        self.publish(trained)
        for version, batch_id in self.state.unacked:
            self.acknowledge(TrainedVersion(version, batch_id, state=None))
        self.acknowledge(trained)

    def publish(self, trained: TrainedVersion) -> None:
        """Publish `trained.state` as `trained.version`; with `trained.snapshot` (a worker asked for
        one) also as a full snapshot. Runs in the outbox's publishing thread after the first
        version (the publisher is used only there)."""
        if trained.checkpoint is not None:  # before the version exists anywhere else
            assert isinstance(self.checkpointer, Checkpointer), "N ranks write their checkpoints at once"
            self.checkpointer.write(trained.checkpoint)
        if trained.state is None:
            return
        state = trained.state
        # Stage trainers publish snapshots together: only when the batch said so, which every rank got.
        snapshot = trained.snapshot or (self.snapshot_asked and self.stages is None)
        published = self.publisher.publish_state(state, trained.version, snapshot)
        if self.local is not None:  # its rounds sampled from this version may now go out
            self.local.published(trained.version)
        if self.stages is not None:
            self.stages.published(self.outbox_client, published)
        if any(done.kind == "snapshot" for done in published):
            self.snapshots_published += 1
            self.snapshot_asked = False
        trained.delta_ratio = self.publisher.delta_ratio(published)

    def acknowledge(self, trained: TrainedVersion) -> None:
        """Ack the batch `trained.version` was trained on (after its publication; in the outbox's
        acking thread after the first version). The answer says whether a worker asked for a
        snapshot, which the next publication then carries."""
        if trained.batch_id:
            if self.stages is not None:
                wait_complete(self.ack_client, trained.version)
            answer = self.ack_client.ack_batch(trained.batch_id, BatchAck(policy_version=trained.version))
            if answer.get("snapshot_requested"):  # only ever raised here, cleared by the publication
                self.snapshot_asked = True

    def batch_request(self, version: int, held: list[str]) -> BatchRequest:
        """A request for the batch that trains at `version` (its staleness is counted there)."""
        return BatchRequest(
            policy_version=version,
            max_groups=self.train.groups_per_step,
            drop_zero_variance=self.algorithm.loss.filters_groups,
            held=held,
            wait_seconds=BATCH_WAIT_SECONDS,
        )

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
                if self.local is not None:  # one round ahead: trained while the next is scored
                    self.local.play_round()
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

    def next_work(self, prefetch: Prefetch | None, outbox: Outbox | None) -> Work | None:
        """Rank 0's next batch on every rank (a collective on N ranks); None: stop."""
        work = self.take_work(prefetch, outbox) if prefetch is not None and outbox is not None else None
        return distributed.broadcast(work, self.ranks)

    def take_work(self, prefetch: Prefetch, outbox: Outbox) -> Work | None:
        """Rank 0: the next batch within the staleness bound, with the one after it requested (it
        is fetched while this one trains and its version goes out); on N ranks a Work without a
        batch after `IDLE_BROADCAST_S` of waiting; None once the run is done or stopping."""
        idle = IDLE_BROADCAST_S if self.ranks.sharded else VERIFY_POLL_S if self.stages is not None else None
        while self.state.policy_version < self.train.num_steps and not self.stop.is_set():
            if self.local is not None:
                self.local.play_round()
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

    def report_run(self) -> bool:
        """Rank 0: give the run directory this trainer's settings and say whether its last version
        is out; True when the run is complete."""
        assert self.client is not None, "rank 0 only"
        shared = shareable(self.config)
        sections = {name: shared[name] for name in TRAINER_SECTIONS}
        run = TrainerRun(
            policy_version=self.state.policy_version,
            num_steps=self.train.num_steps,
            sections=sections,
            complete=self.state.policy_version >= self.train.num_steps,
        )
        return bool(self.client.report_run(run)["complete"])

    def report_base_evaluation(self) -> None:
        """Held-out accuracy of version 0, the policy before any update: the run's "before",
        reported as a step of its own (no train reward) so every reader of the history has it."""
        accuracy = self.evaluate()
        self.ack_client.post_metrics(StepMetrics(policy_version=0, metrics={"eval_accuracy": accuracy}))
        self.trackers.log({"trainer/eval_accuracy": accuracy}, 0)
        log.info(
            "v0 held-out accuracy %.3f (before training, %d problems, greedy)", accuracy, self.train.eval_size
        )

    def complete_message(self) -> str:
        return (
            f"the run is complete: v{self.state.policy_version}/{self.train.num_steps} published; "
            f"nothing left to train (raise trainer.num_steps to train on)"
        )

    def reporter(self, trained: TrainedVersion, metrics: dict[str, float], inspected: list[RolloutLogprobs]):
        """Posts the version's metrics once it is published and acked (in the outbox's acking thread)."""
        version = trained.version

        def report() -> None:
            if trained.delta_ratio is not None:
                metrics["weights_delta_ratio"] = trained.delta_ratio
            step = StepMetrics(policy_version=version, metrics=metrics, rollout_logprobs=inspected)
            for alarm in self.ack_client.post_metrics(step):
                log.warning("v%d reward alarm: %s", version, alarm)
            self.trackers.log({f"trainer/{name}": value for name, value in metrics.items()}, version)
            log.info(
                "v%d from batch %s: reward %.3f staleness %.2f loss %.4f (%d/%d, %s left)",
                version,
                trained.batch_id,
                metrics["reward_mean"],
                metrics["staleness_mean"],
                metrics["loss"],
                version,
                self.train.num_steps,
                eta(metrics["elapsed_seconds"], version - self.first_version, self.train.num_steps - version),
            )

        return report

    def evaluate(self) -> float:
        """Rank 0: held-out greedy accuracy of the current version."""
        if self.ranks.sharded:
            self.eval_engine.load_weights(self.evaluated, self.state.policy_version)
        self.eval_engine.policy_version = self.state.policy_version
        result = evaluate(
            self.eval_engine,
            self.env,
            self.chat,
            self.train.eval_size,
            self.info.sampling.max_new_tokens,
            max_context=self.info.sampling.max_context,
        )
        return result.accuracy

    def close(self) -> None:
        if self.stages is not None:
            self.stages.close()
        if self.client is None:
            if self.stages is not None:
                self.outbox_client.close()
            return
        self.trackers.close()
        if self.local is not None:
            self.local.close()
        for client in (self.client, self.outbox_client, self.ack_client):
            client.close()


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
