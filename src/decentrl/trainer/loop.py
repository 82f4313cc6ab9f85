"""The trainer role: pull ready groups, update the policy, publish version v+1, repeat.

The loop reads as the story of one version: take a batch of groups (the next one is already
being fetched), re-check their staleness, compute advantages, score the batch under pi_prox, take
one AdamW step per mini-batch (trainer/step.py), checkpoint, and hand the new weights to the
outbox (trainer/outbox.py), which publishes them, acknowledges the batch and reports the metrics
(with, every `eval_every` versions, held-out greedy accuracy) while the next version trains.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from decentrl.client import CoordinatorClient
from decentrl.config import ConfigError, RunConfig, adopt_coordinator_sections, shareable
from decentrl.engines.hf import HFEngine
from decentrl.envs import environment_from_config
from decentrl.envs.chat import ChatFormat
from decentrl.eval.evaluate import evaluate
from decentrl.model import lora
from decentrl.model.precision import Precision
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
)
from decentrl.trainer.batch import collate
from decentrl.trainer.checkpoint import Checkpointer, TrainerState, capture
from decentrl.trainer.inspect import rollout_logprobs
from decentrl.trainer.outbox import Outbox, Prefetch, Release
from decentrl.trainer.precision import MasterWeights
from decentrl.trainer.step import Algorithm, train_step
from decentrl.weights.codec import DTYPES, published_state
from decentrl.weights.publisher import Publisher

log = logging.getLogger(__name__)

BATCH_WAIT_SECONDS = 1.0
"""With too few groups ready, the coordinator holds the batch request this long for more (a long
poll: the batch is answered as its last group is scored, not at the next poll)."""


def within_staleness(groups: list[TrainGroup], version: int, max_staleness: int) -> list[TrainGroup]:
    """The trainer's own enforcement of the bound (the coordinator already applied it)."""

    def oldest(group: TrainGroup) -> int:
        return min(
            v for r in group.rollouts for s in r.segments if s.policy_versions for v in s.policy_versions
        )

    return [group for group in groups if version - oldest(group) <= max_staleness]


class Trainer:
    def __init__(self, config: RunConfig, model_dir: Path, run_dir: Path, stop: threading.Event):
        self.config = config
        self.train = config.trainer
        self.stop = stop
        torch.set_num_threads(self.train.num_threads)
        self.client = CoordinatorClient(self.train.coordinator_url, self.train.token, interrupt=stop)
        self.info = self.client.info()
        # Train the coordinator's task (and refuse a config that names another one).
        config = self.config = adopt_coordinator_sections(config, self.info.sections, "trainer")
        self.precision = Precision.from_config(self.train)
        self.model = self.load_model(model_dir)
        self.chat = ChatFormat.from_model_dir(model_dir, self.info.eos_token_ids)
        # The optimizer steps fp32 tensors: the parameters themselves, or their master copies.
        self.master = MasterWeights(self.model)
        self.optimizer = torch.optim.AdamW(
            self.master.parameters(), lr=self.train.lr, weight_decay=self.train.weight_decay
        )
        self.algorithm = Algorithm.from_config(config.algorithm)
        # The KL reference is the frozen initial policy (the warm start), built only when used;
        # a LoRA run has it under its adapters.
        self.reference_model = (
            lora.reference_model(self.model, lambda: self.load_pretrained(model_dir))
            if config.algorithm.kl_coef > 0
            else None
        )
        if any(
            (run_dir / "trainer" / "sharded" / name / "state.json").is_file()
            for name in ("latest", "previous")
        ):
            raise ConfigError(
                f"{run_dir / 'trainer'} holds a sharded checkpoint of the multi-rank trainer; resume "
                "with trainer.nproc > 1 (or torchrun, any number of ranks) or start a new run directory"
            )
        self.checkpointer = Checkpointer(run_dir / "trainer")
        self.env = environment_from_config(config.task)
        # Evaluation shares the live model (no copy): it runs between steps, never during one.
        # (a transformers model, possibly wrapped by peft: HFEngine needs only its forward)
        self.eval_engine = HFEngine(
            cast(PreTrainedModel, self.model),
            self.info.eos_token_ids,
            self.info.pad_token_id,
            device=str(self.precision.device),
        )
        self.state = TrainerState(policy_version=0, batch_id=None)
        self.snapshot_asked = False
        """A worker asked for a snapshot (heard with an ack): the next publication carries one."""
        self.snapshots_published = 0
        self.inspected: list[RolloutLogprobs] = []
        self.first_version = 0
        """The trainer's log-probs of a few rollouts of the last batch (for the dashboard)."""
        # Signed deltas in the inference dtype; the signing key stays in run_dir/trainer.
        # The outbox's two threads (publish; ack and metrics) and the prefetch of the next batch
        # each have a client.
        self.outbox_client = CoordinatorClient(self.train.coordinator_url, self.train.token, interrupt=stop)
        self.ack_client = CoordinatorClient(self.train.coordinator_url, self.train.token, interrupt=stop)
        self.prefetch_client = CoordinatorClient(self.train.coordinator_url, self.train.token, interrupt=stop)
        self.publisher = Publisher(
            self.outbox_client, config.weights, run_dir / "trainer" / "signing_key.pem"
        )
        self.publisher.register()
        self.trackers = open_trackers(config.monitor, run_dir, "trainer", shareable(config))

    def load_pretrained(self, model_dir: Path) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.precision.dtype)
        # transformers wraps `to` in a decorator that pyright reads as an unbound function
        return model.to(self.precision.device).eval()  # pyright: ignore[reportArgumentType]

    def load_model(self, model_dir: Path) -> torch.nn.Module:
        """The policy on the trainer's device in its dtype, with gradient checkpointing when asked
        and, with lora.rank > 0, adapters (then only they train and change between versions)."""
        model: Any = self.load_pretrained(model_dir)  # a transformers model: checkpointing, peft
        if self.train.gradient_checkpointing:
            # Non-reentrant checkpointing also works when the inputs need no gradient (LoRA).
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model = lora.attach(model, self.config.lora)
        log.info(
            "trainer on %s, parameters in %s%s",
            self.precision.device,
            str(self.precision.dtype).removeprefix("torch."),
            " with fp32 master weights" if self.precision.dtype != torch.float32 else "",
        )
        return model

    def resume_or_start(self) -> None:
        if self.checkpointer.exists():
            self.state = self.checkpointer.load(self.model, self.optimizer, self.master)
            log.info("resumed at version %d", self.state.policy_version)
        else:
            self.checkpointer.save(self.model, self.optimizer, self.state, self.master)
        self.publish_and_ack(
            Release(self.state.policy_version, self.state.batch_id or "", self.publication())
        )

    def publication(self) -> dict[str, torch.Tensor]:
        """The weights to publish, in the inference dtype and copied: training goes on while the
        outbox encodes them."""
        live = lora.publication_state(self.model)
        state = published_state(live, self.config.weights.dtype)
        return {
            name: tensor.clone() if tensor.data_ptr() == live[name].data_ptr() else tensor
            for name, tensor in state.items()
        }

    def publish_and_ack(self, release: Release) -> None:
        """Idempotent: a restart re-publishes the checkpointed version and acks its batch, and
        first the batches of earlier versions whose acks were still on their way at the crash
        (left unacked, the coordinator would hand them out again: trained twice)."""
        self.publish(release)
        for version, batch_id in self.state.unacked:
            self.acknowledge(Release(version, batch_id, state=None))
        self.acknowledge(release)

    def publish(self, release: Release) -> None:
        """Publish `release.state` as `release.version`; with `release.snapshot` (a worker asked for
        one) also as a full snapshot. Runs in the outbox's publishing thread after the first
        version (the publisher is used only there)."""
        if release.checkpoint is not None:  # before the version exists anywhere else
            self.checkpointer.write(release.checkpoint)
        if release.state is None:
            return
        state = release.state
        snapshot = release.snapshot or self.snapshot_asked
        published = self.publisher.publish_state(state, release.version, snapshot)
        if any(done.kind == "snapshot" for done in published):
            self.snapshots_published += 1
            self.snapshot_asked = False
        # What a worker one version behind downloads, over the state's size in the inference dtype.
        itemsize = DTYPES[self.config.weights.dtype].itemsize
        state_bytes = sum(t.numel() for t in state.values()) * itemsize
        deltas = [done.payload_bytes for done in published if done.kind == "delta"]
        release.delta_ratio = deltas[0] / state_bytes if deltas else None
        for done in published:
            log.info(
                "published v%d %s%s (%d bytes, %s, encoded in %.2fs)",
                done.version,
                done.kind,
                "" if done.anchor is None else f" against anchor v{done.anchor}",
                done.payload_bytes,
                done.encodings,
                done.encode_seconds,
            )

    def acknowledge(self, release: Release) -> None:
        """Ack the batch `release.version` was trained on (after its publication; in the outbox's
        acking thread after the first version). The answer says whether a worker asked for a
        snapshot, which the next publication then carries."""
        if release.batch_id:
            answer = self.ack_client.ack_batch(release.batch_id, BatchAck(policy_version=release.version))
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
        version = self.state.policy_version
        max_new_tokens = self.info.sampling.max_new_tokens

        def shaping(rewards_b: torch.Tensor, lengths_b: torch.Tensor) -> torch.Tensor:
            return self.algorithm.loss.shape_rewards(rewards_b, lengths_b, max_new_tokens)

        tensors = collate(groups, self.info.pad_token_id, self.algorithm.advantage, shaping)
        started = time.perf_counter()
        metrics = train_step(
            self.model,
            self.optimizer,
            tensors,
            self.algorithm,
            self.train,
            self.info.sampling.temperature,
            version,
            max_new_tokens,
            self.reference_model,
            self.master,
        )
        metrics["step_seconds"] = time.perf_counter() - started
        self.inspected = rollout_logprobs(groups, tensors, self.config.monitor.inspect_rollouts)
        metrics["accuracy"] = float((tensors.rewards_b == 1.0).float().mean())
        return metrics

    def run(self) -> int:
        run_started = time.monotonic()
        self.resume_or_start()
        self.first_version = self.state.policy_version  # the pace (ETA) is this process's own
        if self.report_run():
            log.info(self.complete_message())
            return 0
        outbox = Outbox(self.publish, self.acknowledge)
        prefetch = Prefetch(self.prefetch_client, self.stop, self.train.poll_seconds)
        try:
            prefetch.start(self.batch_request(self.state.policy_version, held=[]))
            if self.state.policy_version == 0 and self.train.eval_every:
                self.report_base_evaluation()  # while the first batch is fetched
            snapshots_before = self.snapshots_published
            while self.state.policy_version < self.train.num_steps and not self.stop.is_set():
                batch = prefetch.take()
                if batch is None:
                    break
                # The next batch is fetched while this one trains and its version goes out.
                # A snapshot asked for before this batch was fetched and published since needs no other.
                snapshot = batch.snapshot_requested and self.snapshots_published == snapshots_before
                held = [*outbox.held(), batch.batch_id]
                prefetch.start(self.batch_request(self.state.policy_version + 1, held))
                snapshots_before = self.snapshots_published
                groups = within_staleness(batch.groups, self.state.policy_version, self.info.max_staleness)
                if not groups:  # the coordinator applies the same bound, so this means a version mix-up
                    log.warning(
                        "batch %s: every group exceeds max_staleness; acked untrained", batch.batch_id
                    )
                    outbox.put(Release(self.state.policy_version, batch.batch_id, state=None))
                    continue
                metrics = self.step(groups)
                metrics["elapsed_seconds"] = time.monotonic() - run_started  # since this process started
                metrics["groups_expired"] = float(batch.num_groups_expired + len(batch.groups) - len(groups))
                self.state = TrainerState(
                    policy_version=self.state.policy_version + 1,
                    batch_id=batch.batch_id,
                    unacked=outbox.unacked(),
                )
                # Copied now, written by the outbox before the version goes out: a restart
                # re-publishes exactly the last version written, acks its batch and the earlier
                # ones not yet confirmed, and its batch's successors return.
                checkpoint = capture(self.model, self.optimizer, self.state, self.master)
                version = self.state.policy_version
                release = Release(version, batch.batch_id, self.publication(), snapshot, checkpoint)
                if self.train.eval_every and version % self.train.eval_every == 0:
                    metrics["eval_accuracy"] = self.evaluate()
                release.report = self.reporter(release, metrics, self.inspected)
                outbox.put(release)
            outbox.wait()
        finally:
            outbox.close()
            prefetch.close()
        if self.state.policy_version >= self.train.num_steps and self.report_run():
            log.info(self.complete_message())
        return 0

    def report_run(self) -> bool:
        """Give the run directory this trainer's settings and say whether its last version is out;
        True when the run is complete."""
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

    def reporter(self, release: Release, metrics: dict[str, float], inspected: list[RolloutLogprobs]):
        """Posts the version's metrics once it is published and acked (in the outbox's acking thread)."""
        version = release.version

        def report() -> None:
            if release.delta_ratio is not None:
                metrics["weights_delta_ratio"] = release.delta_ratio
            step = StepMetrics(policy_version=version, metrics=metrics, rollout_logprobs=inspected)
            for alarm in self.ack_client.post_metrics(step):
                log.warning("v%d reward alarm: %s", version, alarm)
            self.trackers.log({f"trainer/{name}": value for name, value in metrics.items()}, version)
            log.info(
                "v%d/%d reward %.3f staleness %.2f loss %.4f, %s left",
                version,
                self.train.num_steps,
                metrics["reward_mean"],
                metrics["staleness_mean"],
                metrics["loss"],
                eta(metrics["elapsed_seconds"], version - self.first_version, self.train.num_steps - version),
            )

        return report

    def evaluate(self) -> float:
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


def run_trainer(
    config: RunConfig, model_dir: Path, run_dir: Path, stop: threading.Event | None = None
) -> int:
    trainer = Trainer(config, model_dir, run_dir, stop or threading.Event())
    try:
        return trainer.run()
    finally:
        trainer.trackers.close()
        trainer.client.close()
        trainer.outbox_client.close()
        trainer.ack_client.close()


def main_trainer(config: RunConfig, model_dir: Path, run_dir: Path) -> int:
    """CLI entry: SIGTERM/SIGINT finish the current step (checkpointed and published), then exit 0."""
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        log.info("%s: finishing the current step, then exiting", signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    return run_trainer(config, model_dir, run_dir, stop)
