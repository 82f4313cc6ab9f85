"""What the pipeline dimension adds to each rank of the trainer (`trainer.pipeline_stages = K`).

The trainer (`loop.py`) runs on K ranks, rank s the trainer of stage s: it holds that stage alone
(`stage_model.py`), runs its part of every pass (`pipeline_parallel.py`), checkpoints it
(`stage_checkpoint.py`) and publishes it: every rank has its own signing key
(`run_dir/trainer/stage-S/signing_key.pem`, registered with the coordinator for its stage) and
publisher, whose manifests carry its stage only. Rank 0 is still the only one that asks the
coordinator for batches, acks them and reports; it acks a version's batch once the coordinator
lists the version, i.e. once every stage's manifest of it is in. With `weights.store = "peers"`
each rank keeps its published chunks in `stage-S/chunks` and serves them (`weights/peer_store.py`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from decentrl.client import CoordinatorClient
from decentrl.config import ConfigError, LoraConfig, RunConfig
from decentrl.protocol import ServerInfo, VerifyJob
from decentrl.trainer.distributed import Ranks
from decentrl.trainer.pipeline_parallel import PipelineRunner
from decentrl.trainer.stage_model import StageModel, load_stage_model, published_name
from decentrl.trainer.stage_verification import StageVerifier, verify_round
from decentrl.weights.chunks import ChunkStore
from decentrl.weights.codec import published_state
from decentrl.weights.peer_store import TrainerChunks, stage_chunks
from decentrl.weights.publisher import Published, Publisher

log = logging.getLogger(__name__)

MATERIALISED_FILE = "materialised.txt"
COMPLETE_POLL_SECONDS = 0.05
COMPLETE_TIMEOUT_SECONDS = 600.0
"""Longest wait for the other stages' manifests of a version (they publish at the same time)."""


def stage_dir(run_dir: Path, stage: int) -> Path:
    """Where stage trainer `stage` keeps its key, checkpoints and (peers mode) chunks."""
    return run_dir / "trainer" / f"stage-{stage}"


@dataclass
class StageTraining:
    stage_model: StageModel
    runner: PipelineRunner
    directory: Path
    verifier: StageVerifier
    """This stage's part in verifying sampled rollouts (`stage_verification.py`)."""
    chunks: TrainerChunks | None = None
    """Peers mode: the chunks this stage published, and the server that serves them."""

    @classmethod
    def open(
        cls, config: RunConfig, info: ServerInfo, model_dir: Path, run_dir: Path, ranks: Ranks
    ) -> StageTraining:
        """Stage `ranks.rank` of the run's policy, ready to train (on a run the coordinator knows is
        trained by this many stage trainers)."""
        stage_map = info.stage_map
        if stage_map is None or stage_map.num_stages != ranks.stages or info.stage_keys is None:
            staged = "not staged" if stage_map is None else f"staged as {stage_map.describe()}"
            raise ConfigError(
                f"trainer.pipeline_stages = {ranks.stages} needs a coordinator whose run is split into as many "
                f"stages with trainer.pipeline_stages = {ranks.stages} too; this one's run is {staged}"
                + ("" if info.stage_keys is not None else " and has one trainer")
            )
        device = str(ranks.device)
        stage_model = load_stage_model(model_dir, stage_map, ranks.rank, config.lora, config.seed, device)
        if config.trainer.gradient_checkpointing:
            causal: Any = stage_model.model  # a transformers causal LM; torch.nn.Module does not declare it
            causal.get_decoder().gradient_checkpointing = True
        reference = None
        if config.algorithm.kl_coef > 0 and config.lora.rank == 0:  # with LoRA: the stage, adapters off
            reference = load_stage_model(
                model_dir, stage_map, ranks.rank, LoraConfig(rank=0), config.seed, device
            )
            reference.model.requires_grad_(False)
        trainer = config.trainer
        runner = PipelineRunner(
            stage_model, ranks, trainer.pipeline_schedule, reference, trainer.boundary_codec
        )
        directory = stage_dir(run_dir, ranks.rank)
        directory.mkdir(parents=True, exist_ok=True)
        chunks = None
        if config.weights.store == "peers":
            store = ChunkStore(stage_chunks(run_dir, ranks.rank))
            chunks = TrainerChunks(
                store,
                ranks.rank,
                config.weights.keep_versions,
                config.trainer.peer_host,
                config.trainer.peer_url,
            )
            log.info("stage %d's chunks are served at %s", ranks.rank, chunks.address)
        log.info(
            "stage trainer %d of %d: %s, %d tensors held",
            ranks.rank,
            ranks.stages,
            stage_map.describe().split(", ")[ranks.rank],
            len(stage_model.stage.materialised),
        )
        # The versions a rollout within max_staleness claims, and the one training.
        window = info.max_staleness + 2
        verifier = StageVerifier(model_dir, stage_map, ranks.rank, window, info.pad_token_id)
        # What this process allocated, read back from its models: the trained stage and the copy it
        # verifies with (a test checks that no rank held the whole model).
        held = {published_name(name) for name in stage_model.stage.materialised | verifier.stage.materialised}
        (directory / MATERIALISED_FILE).write_text("\n".join(sorted(held)) + "\n")
        return cls(stage_model, runner, directory, verifier, chunks)

    def publisher(self, client: CoordinatorClient, config: RunConfig, info: ServerInfo) -> Publisher:
        """This stage's publisher, signing with this stage trainer's own key."""
        return Publisher(
            client,
            config.weights,
            self.directory / "signing_key.pem",
            info.stage_map,
            stage=self.stage_model.index,
            chunks=None if self.chunks is None else self.chunks.store,
        )

    def published(self, client: CoordinatorClient, done: list[Published]) -> None:
        """After a publication (peers mode): remember its chunks, drop those of versions no longer
        retained, and tell the coordinator where this stage's chunks are and up to which version."""
        if self.chunks is None or not done:
            return
        for item in done:
            self.chunks.record((item.version, item.kind, item.anchor), item.chunks)
        self.chunks.prune()
        self.chunks.announce(client, max(item.version for item in done))

    def close(self) -> None:
        if self.chunks is not None:
            self.chunks.close()

    def publication(self, dtype: str, version: int) -> dict[str, torch.Tensor]:
        """This stage's tensors of `version` as published, copied (training goes on while they are
        encoded), and kept to verify rollouts that claim it."""
        live = self.stage_model.state()
        state = published_state(live, dtype)  # type: ignore[arg-type]
        copied = {
            name: tensor.clone() if tensor.data_ptr() == live[name].data_ptr() else tensor
            for name, tensor in state.items()
        }
        self.verifier.keep(version, copied)
        return copied

    def verify(self, jobs: list[VerifyJob], ranks: Ranks, client: CoordinatorClient | None) -> None:
        """A collective: every stage checks `jobs` on its stage, rank 0 posts the verdicts."""
        batch = verify_round(self.verifier, jobs, ranks)
        if batch is not None and client is not None:
            client.post_verdicts(batch)


def wait_complete(client: CoordinatorClient, version: int) -> None:
    """Until the coordinator lists `version`: every stage trainer's manifest of it is in (rank 0
    acks its batch only then: an acked batch's version exists, whole)."""
    deadline = time.monotonic() + COMPLETE_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        latest = client.latest_weights()
        if latest is not None and latest.version >= version:
            return
        time.sleep(COMPLETE_POLL_SECONDS)
    raise RuntimeError(
        f"v{version} is not complete after {COMPLETE_TIMEOUT_SECONDS:.0f} s: a stage trainer did not publish it"
    )
