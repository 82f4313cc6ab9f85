"""The trainer's set-up: what each rank holds before its first version, and what it closes.

Every rank asks the coordinator for the run (`/v1/info`, broadcast from rank 0) and takes its
sections, loads the policy (with LoRA adapters, gradient checkpointing; on N ranks sharded by
FSDP2; a stage trainer its stage alone), its fp32 master weights and AdamW, the KL reference when
used, and its checkpointer. Rank 0 alone also opens the coordinator's clients, the evaluation
engine, the publisher, the trackers and, colocated, its own rounds of rollouts; a stage trainer
opens the publisher of its stage. `Trainer` (`loop.py`) builds on it.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, cast

import torch
from transformers import PreTrainedModel

from decentrl.client import CoordinatorClient
from decentrl.config import ConfigError, RunConfig, adopt_coordinator_sections, check_ranks, shareable
from decentrl.engines.hf import HFEngine
from decentrl.envs import environment_from_config
from decentrl.envs.chat import ChatFormat
from decentrl.model import lora
from decentrl.model.precision import Precision
from decentrl.model.vision import PixelInputs, load_policy
from decentrl.monitor.trackers import open_trackers
from decentrl.protocol import RolloutLogprobs
from decentrl.trainer import distributed
from decentrl.trainer.checkpoint import TrainerState
from decentrl.trainer.distributed import Ranks
from decentrl.trainer.local_rollouts import LocalRollouts, SamplerSpec
from decentrl.trainer.master_weights import MasterWeights
from decentrl.trainer.sharded_checkpoint import open_checkpointer
from decentrl.trainer.stage_training import StageTraining
from decentrl.trainer.step import Algorithm
from decentrl.weights.publisher import Publisher
from decentrl.weights.unique_storage import state_for_publication

log = logging.getLogger(__name__)


class TrainerSetup:
    """What one rank of the trainer holds: opened here, closed by `close`; `Trainer` (`loop.py`) runs
    the loop on it."""

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
        self.local: LocalRollouts | None = None
        if self.train.local_groups and main:  # colocated: forked before anything is loaded
            self.local = LocalRollouts(self.sampler_spec(model_dir), until_version=self.train.num_steps)
        try:
            self.open(config, model_dir, run_dir, stop, ranks)
        except BaseException:
            if self.local is not None:
                self.local.kill()
            raise

    def sampler_spec(self, model_dir: Path) -> SamplerSpec:
        return SamplerSpec(
            groups=self.train.local_groups,
            model_dir=model_dir,
            coordinator_url=self.train.coordinator_url,
            token=self.train.token,
            device=str(self.precision.device),
            dtype=str(self.precision.dtype).removeprefix("torch."),
            num_threads=self.train.num_threads,
        )

    def open(
        self, config: RunConfig, model_dir: Path, run_dir: Path, stop: threading.Event, ranks: Ranks
    ) -> None:
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
