"""The trainer role: pull ready groups, update the policy, publish version v+1, repeat.

The loop reads as the story of one version: wait for a batch of groups, re-check their
staleness, compute advantages, score the batch under pi_prox, take one AdamW step per mini-batch
(trainer/step.py), checkpoint, publish the new weights, acknowledge the batch, report metrics
(and, every `eval_every` versions, held-out greedy accuracy).
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
from decentrl.config import SECRET_FIELDS, ConfigError, RunConfig, adopt_coordinator_sections
from decentrl.engines.hf import HFEngine
from decentrl.envs import environment_from_config
from decentrl.envs.chat import ChatFormat
from decentrl.eval.evaluate import evaluate
from decentrl.model import lora
from decentrl.model.precision import Precision
from decentrl.monitor.trackers import open_trackers
from decentrl.protocol import BatchAck, BatchRequest, RolloutLogprobs, StepMetrics, TrainGroup
from decentrl.trainer.batch import collate
from decentrl.trainer.checkpoint import Checkpointer, TrainerState
from decentrl.trainer.inspect import rollout_logprobs
from decentrl.trainer.precision import MasterWeights
from decentrl.trainer.step import Algorithm, train_step
from decentrl.weights.codec import DTYPES
from decentrl.weights.publisher import Publisher

log = logging.getLogger(__name__)


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
        self.delta_ratio: float | None = None
        self.inspected: list[RolloutLogprobs] = []
        """The trainer's log-probs of a few rollouts of the last batch (for the dashboard)."""
        """Delta bytes of the last published version over the state in the inference dtype."""
        # Signed deltas in the inference dtype; the signing key stays in run_dir/trainer.
        self.publisher = Publisher(self.client, config.weights, run_dir / "trainer" / "signing_key.pem")
        self.publisher.register()
        self.trackers = open_trackers(
            config.monitor, run_dir, "trainer", config.model_dump(mode="json", exclude=SECRET_FIELDS)
        )

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
        self.publish_and_ack()

    def publish_and_ack(self, snapshot: bool = False) -> None:
        """Idempotent: a restart re-publishes the checkpointed version and acks its batch. With
        `snapshot` (a worker asked for one) the version also goes out as a full snapshot."""
        state = lora.publication_state(self.model)
        published = self.publisher.publish_state(state, self.state.policy_version, snapshot)
        # What a worker one version behind downloads, over the state's size in the inference dtype.
        state_bytes = sum(t.numel() for t in state.values()) * DTYPES[self.config.weights.dtype].itemsize
        deltas = [done.payload_bytes for done in published if done.kind == "delta"]
        self.delta_ratio = deltas[0] / state_bytes if deltas else None
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
        if self.state.batch_id is not None:
            self.client.ack_batch(self.state.batch_id, BatchAck(policy_version=self.state.policy_version))

    def next_batch(self):
        request = BatchRequest(
            policy_version=self.state.policy_version,
            max_groups=self.train.groups_per_step,
            drop_zero_variance=self.algorithm.loss.filters_groups,
        )
        while not self.stop.is_set():
            batch = self.client.next_batch(request)
            if batch is not None:
                return batch
            time.sleep(self.train.poll_seconds)
        return None

    def step(self, groups: list[TrainGroup]) -> dict[str, float]:
        version = self.state.policy_version
        max_new_tokens = self.info.sampling.max_new_tokens

        def shaping(rewards_b: torch.Tensor, lengths_b: torch.Tensor) -> torch.Tensor:
            return self.algorithm.loss.shape_rewards(rewards_b, lengths_b, max_new_tokens)

        tensors = collate(groups, self.info.pad_token_id, self.algorithm.advantage, shaping)
        self.inspected = rollout_logprobs(
            self.model, groups, tensors, self.info.sampling.temperature, self.config.monitor.inspect_rollouts
        )
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
        metrics["accuracy"] = float((tensors.rewards_b == 1.0).float().mean())
        return metrics

    def run(self) -> int:
        run_started = time.monotonic()
        self.resume_or_start()
        while self.state.policy_version < self.train.num_steps and not self.stop.is_set():
            batch = self.next_batch()
            if batch is None:
                break
            groups = within_staleness(batch.groups, self.state.policy_version, self.info.max_staleness)
            if not groups:  # the coordinator applies the same bound, so this means a version mix-up
                log.warning("batch %s: every group exceeds max_staleness; acked untrained", batch.batch_id)
                self.client.ack_batch(batch.batch_id, BatchAck(policy_version=self.state.policy_version))
                continue
            metrics = self.step(groups)
            metrics["elapsed_seconds"] = time.monotonic() - run_started  # since this process started
            metrics["groups_expired"] = float(batch.num_groups_expired + len(batch.groups) - len(groups))
            self.state = TrainerState(policy_version=self.state.policy_version + 1, batch_id=batch.batch_id)
            self.checkpointer.save(self.model, self.optimizer, self.state, self.master)
            self.publish_and_ack(snapshot=batch.snapshot_requested)
            if self.delta_ratio is not None:
                metrics["weights_delta_ratio"] = self.delta_ratio
            version = self.state.policy_version
            if self.train.eval_every and version % self.train.eval_every == 0:
                metrics["eval_accuracy"] = self.evaluate()
            step = StepMetrics(policy_version=version, metrics=metrics, rollout_logprobs=self.inspected)
            for alarm in self.client.post_metrics(step):
                log.warning("v%d reward alarm: %s", version, alarm)
            self.trackers.log({f"trainer/{name}": value for name, value in metrics.items()}, version)
            log.info(
                "v%d reward %.3f staleness %.2f loss %.4f",
                version,
                metrics["reward_mean"],
                metrics["staleness_mean"],
                metrics["loss"],
            )
        return 0

    def evaluate(self) -> float:
        self.eval_engine.policy_version = self.state.policy_version
        result = evaluate(
            self.eval_engine,
            self.env,
            self.chat,
            self.train.eval_size,
            self.info.sampling.max_new_tokens,
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


def main_trainer(config: RunConfig, model_dir: Path, run_dir: Path) -> int:
    """CLI entry: SIGTERM/SIGINT finish the current step (checkpointed and published), then exit 0."""
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        log.info("%s: finishing the current step, then exiting", signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    return run_trainer(config, model_dir, run_dir, stop)
