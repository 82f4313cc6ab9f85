"""What the trainer makes of each version outside itself: its publication (signed, a stage trainer's
of its stage), the ack of the batch it was trained on, its metrics (with, every `eval_every`
versions, held-out greedy accuracy), and the run directory's record of this trainer.

The outbox (`outbox.py`) runs `publish` and `acknowledge` in its threads, each version in order,
while the next one trains; a restart re-publishes the checkpointed version and acks its batch
(`publish_and_ack`). `Trainer` (`loop.py`) builds on it.
"""

from __future__ import annotations

import logging

import torch

from decentrl.config import shareable
from decentrl.eval.evaluate import evaluate
from decentrl.model import lora
from decentrl.monitor.reporting import eta
from decentrl.protocol import TRAINER_SECTIONS, BatchAck, RolloutLogprobs, StepMetrics, TrainerRun
from decentrl.trainer import distributed
from decentrl.trainer.checkpoint import Checkpointer
from decentrl.trainer.outbox import TrainedVersion
from decentrl.trainer.stage_training import wait_complete
from decentrl.trainer.trainer_setup import TrainerSetup
from decentrl.weights.codec import published_state

log = logging.getLogger(__name__)


class TrainerPublication(TrainerSetup):
    """Each version's publication (by rank 0, or by every stage trainer of its stage), the ack of its
    batch and rank 0's reports."""

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
        local, version = self.local, trained.version
        # A colocated trainer's rounds sampled from this version go out once the coordinator holds it.
        registered = None if local is None else lambda: local.published(version)
        published = self.publisher.publish_state(state, version, snapshot, registered=registered)
        if self.stages is not None:
            self.stages.published(self.outbox_client, published)
        if any(done.kind == "snapshot" for done in published):
            self.snapshots_published += 1
            self.snapshot_asked = False
        trained.delta_ratio = self.publisher.delta_ratio(published)

    def acknowledge(self, trained: TrainedVersion) -> None:
        """Ack the batch `trained.version` was trained on (after its publication; in the outbox's
        acking thread after the first version). The answer says whether a worker asked for a
        snapshot, which the next publication then carries, and how many workers were seen lately:
        with none (a colocated trainer alone) the next publications carry no catch-up patches."""
        if trained.batch_id:
            if self.stages is not None:
                wait_complete(self.ack_client, trained.version)
            answer = self.ack_client.ack_batch(trained.batch_id, BatchAck(policy_version=trained.version))
            if answer.get("snapshot_requested"):  # only ever raised here, cleared by the publication
                self.snapshot_asked = True
            if self.stages is None and "workers_seen" in answer:  # nobody to catch up: no patches
                self.publisher.catch_up = answer["workers_seen"] > 0

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
