"""Checkpoints of a multi-rank trainer: model and AdamW state sharded with torch.distributed.checkpoint.

Each rank writes its own shards (DCP's `.distcp` files plus rank 0's `.metadata`), so no rank ever
holds the whole optimizer state. DCP records every tensor's global shape and each shard's offsets,
so a checkpoint written by N ranks loads on any other number of ranks: each reads the pieces that
fall into its new shard. Same ordering contract as the 1-process `Checkpointer` (written before the
version is published and its batch acked; `latest` replaced by one rename after every rank has
finished writing), in `run_dir/trainer/sharded/`. The directory must be shared by all ranks (one
node, or a shared filesystem across nodes).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from decentrl.config import ConfigError
from decentrl.trainer.checkpoint import CheckpointData, Checkpointer, TrainerState, promote
from decentrl.trainer.distributed import Ranks
from decentrl.trainer.master_weights import MasterWeights

if TYPE_CHECKING:
    from decentrl.trainer.stage_checkpoint import StageCheckpointer


class ShardedCheckpointer:
    def __init__(self, directory: Path, ranks: Ranks):
        self.directory = directory
        self.ranks = ranks
        if ranks.is_main:
            directory.mkdir(parents=True, exist_ok=True)
        dist.barrier()

    def _source(self) -> Path | None:
        # A crash between the two renames of `save` leaves only `previous`: still a checkpoint.
        for name in ("latest", "previous"):
            if (self.directory / name / "state.json").is_file():
                return self.directory / name
        return None

    def exists(self) -> bool:
        return self._source() is not None

    def save(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state: TrainerState,
        master: MasterWeights | None = None,
    ) -> None:
        """Collective: every rank calls it (rank 0's `state` is the one written). The sharded fp32
        parameters are what the optimizer steps: there are no separate master weights to store."""
        assert master is None or not master.separate, "FSDP2 ranks step their fp32 shards"
        staging = self.directory / "staging"
        if self.ranks.is_main and staging.exists():  # left by a crash mid-write
            shutil.rmtree(staging)
        dist.barrier()
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp_save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=staging)
        if self.ranks.is_main:
            with open(staging / "state.json", "w") as handle:
                handle.write(json.dumps(state.__dict__))
                handle.flush()
                os.fsync(handle.fileno())  # DCP fsyncs the shards it writes (sync_files)
        # Only after every rank's shards are on disk may `latest` move (dcp_save ends with its own
        # barrier; this one also covers state.json).
        dist.barrier()
        if self.ranks.is_main:
            promote(staging)
        dist.barrier()

    def commit(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state: TrainerState,
        master: MasterWeights | None = None,
    ) -> CheckpointData | None:
        """The checkpoint of a trained version, written now by every rank (a collective: no copy
        for the outbox to write later); the caller first waits for the previous version's
        publication, so a restart never finds a version checkpointed past one not yet out."""
        self.save(model, optimizer, state, master)
        return None

    def load(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, master: MasterWeights | None = None
    ) -> TrainerState:
        """Collective. Resharding happens here: the checkpoint may come from another number of ranks."""
        source = self._source()
        assert source is not None, "load() without a checkpoint"
        # The optimizer's state must exist to be loaded into; get_state_dict creates it (zeros).
        model_state, optimizer_state = get_state_dict(model, optimizer)
        target = {"model": model_state, "optimizer": optimizer_state}
        try:
            dcp_load(target, checkpoint_id=source)
        except RuntimeError as exc:  # DCP names the missing or misshapen key
            raise ValueError(
                f"checkpoint {source} does not fit the model ({str(exc).splitlines()[0][:200]}); resume "
                "with the settings it was written with (model, lora)"
            ) from None
        set_state_dict(
            model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optimizer"]
        )
        return TrainerState(**json.loads((source / "state.json").read_text()))


def open_checkpointer(
    directory: Path, ranks: Ranks
) -> Checkpointer | ShardedCheckpointer | StageCheckpointer:
    """The checkpointer for this number of ranks, in `directory` (run_dir/trainer); a checkpoint
    of the other kind there is refused with the setting that resumes it."""

    def holds(parent: Path) -> bool:
        return any((parent / name / "state.json").is_file() for name in ("latest", "previous"))

    if ranks.pipelined:
        from decentrl.trainer.stage_checkpoint import StageCheckpointer

        if holds(directory) or holds(directory / "sharded"):
            raise ConfigError(
                f"{directory} holds the checkpoint of a trainer of the whole model; stage trainers "
                "(trainer.pipeline_stages > 1) start a new run directory"
            )
        return StageCheckpointer(directory / f"stage-{ranks.rank}", ranks)

    if ranks.sharded:
        if holds(directory):
            raise ConfigError(
                f"{directory} holds a 1-process checkpoint; resume this run with trainer.nproc=1 "
                "(without torchrun) or start a new run directory"
            )
        return ShardedCheckpointer(directory / "sharded", ranks)
    if holds(directory / "sharded"):
        raise ConfigError(
            f"{directory} holds a sharded checkpoint of the multi-rank trainer; resume "
            "with trainer.nproc > 1 (or torchrun, any number of ranks) or start a new run directory"
        )
    return Checkpointer(directory)
