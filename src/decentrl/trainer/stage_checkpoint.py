"""Checkpoints of stage trainers: each rank its own stage, resumed together at one common version.

A stage trainer writes its stage's parameters, AdamW state and the version's bookkeeping to
`run_dir/trainer/stage-S/vNNNNNNNN/` (files fsynced, then one rename into place, then the
directory fsynced), then waits at a barrier for every other stage to have written the same
version, and only then drops its older checkpoints and lets the version be published. So:

- a version some stage has published is checkpointed by every stage (the barrier comes first);
- after a crash the stages hold at most two neighbouring versions: the restart loads the newest
  version *every* stage holds, and a stage that got one further drops that never-published one
  (its batch was not acked, so the coordinator hands it out again: trained once, by everyone);
- stages holding no common version (a directory restored from another run, a stage's directory
  lost) refuse to start with a message that says what each stage holds.

Only the stage's own tensors are written (by their names in the live model), in fp32, so a resume
is exact; the one-process and FSDP2 checkpoints are `checkpoint.py` and `sharded_checkpoint.py`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from decentrl.config import ConfigError
from decentrl.trainer.checkpoint import CheckpointData, TrainerState
from decentrl.trainer.distributed import Ranks
from decentrl.trainer.master_weights import MasterWeights
from decentrl.weights.chunks import _fsync_dir

STATE_FILE = "state.json"


def version_name(version: int) -> str:
    return f"v{version:08d}"


class StageCheckpointer:
    """This rank's stage's checkpoints in `directory` (run_dir/trainer/stage-S)."""

    def __init__(self, directory: Path, ranks: Ranks):
        assert ranks.pipelined, "stage trainers only"
        self.directory = directory
        self.ranks = ranks
        directory.mkdir(parents=True, exist_ok=True)
        for leftover in directory.glob(".staging-*"):  # a crash mid-write
            shutil.rmtree(leftover, ignore_errors=True)

    def held(self) -> list[int]:
        """The versions this stage holds a complete checkpoint of, oldest first."""
        return sorted(
            int(path.name[1:])
            for path in self.directory.glob("v*")
            if path.name[1:].isdigit() and (path / STATE_FILE).is_file()
        )

    def _everyone(self) -> list[list[int]]:
        """Each stage's held versions, on every stage (a collective)."""
        gathered: list[list[int] | None] = [None] * self.ranks.world_size
        dist.all_gather_object(gathered, self.held())
        return [versions or [] for versions in gathered]

    def exists(self) -> bool:
        """Collective. True when every stage holds checkpoints, False when none does; a mix (a stage
        trainer's directory lost or new) is refused."""
        held = self._everyone()
        if not any(held):
            return False
        if not all(held):
            raise ConfigError(f"stage trainers' checkpoints are incomplete: {_describe(held)}; {_FIX}")
        return True

    def load(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, master: MasterWeights | None = None
    ) -> TrainerState:
        """Collective: every stage resumes at the newest version all of them hold."""
        held = self._everyone()
        common = set.intersection(*(set(versions) for versions in held))
        if not common:
            raise ConfigError(f"stage trainers share no checkpointed version: {_describe(held)}; {_FIX}")
        version = max(common)
        for newer in [v for v in self.held() if v > version]:
            # Written by this stage only, before the barrier: never published, its batch never acked.
            shutil.rmtree(self.directory / version_name(newer))
        source = self.directory / version_name(version)
        tensors = load_file(str(source / "stage.safetensors"))
        live = {name: p for name, p in model.named_parameters() if not p.is_meta}
        if set(live) != set(tensors):
            missing, unexpected = sorted(set(live) - set(tensors)), sorted(set(tensors) - set(live))
            raise ValueError(
                f"checkpoint {source} does not fit stage {self.ranks.rank} (missing {missing[:3]}, unexpected "
                f"{unexpected[:3]}); resume with the settings it was written with (model, lora, stages)"
            )
        with torch.no_grad():
            for name, parameter in live.items():
                parameter.copy_(tensors[name])
        optimizer.load_state_dict(torch.load(source / "optimizer.pt", weights_only=True))
        return TrainerState(**json.loads((source / STATE_FILE).read_text()))

    def save(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state: TrainerState,
        master: MasterWeights | None = None,
    ) -> None:
        """Collective: write this stage's checkpoint of `state.policy_version`, wait until every
        stage has written its own, then drop the older ones."""
        assert master is None or not master.separate, "stage trainers step their fp32 parameters"
        staging = self.directory / f".staging-{os.getpid()}"
        staging.mkdir()
        tensors = {
            name: p.detach().cpu().contiguous() for name, p in model.named_parameters() if not p.is_meta
        }
        save_file(tensors, str(staging / "stage.safetensors"))
        torch.save(optimizer.state_dict(), staging / "optimizer.pt")
        (staging / STATE_FILE).write_text(json.dumps(state.__dict__))
        for path in staging.iterdir():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(staging)
        final = self.directory / version_name(state.policy_version)
        if final.exists():  # the same version again (a re-run of an interrupted start)
            shutil.rmtree(final)
        staging.rename(final)
        _fsync_dir(self.directory)
        # No stage may publish this version before every stage has it on disk (see the docstring).
        dist.barrier()
        for older in [v for v in self.held() if v < state.policy_version]:
            shutil.rmtree(self.directory / version_name(older))

    def commit(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state: TrainerState,
        master: MasterWeights | None = None,
    ) -> CheckpointData | None:
        """Written now by every stage (a collective, after the previous version's publication)."""
        self.save(model, optimizer, state, master)
        return None


_FIX = (
    "restore the stage trainers' run_dir/trainer/stage-* directories of one run, or start a new run directory"
)


def _describe(held: list[list[int]]) -> str:
    return ", ".join(
        f"stage {stage} holds " + (", ".join(f"v{v}" for v in versions) if versions else "nothing")
        for stage, versions in enumerate(held)
    )
