"""Trainer checkpoints: model, optimizer and the version/batch bookkeeping, written atomically.

Every version's checkpoint is written *before* the version is published and its batch acked, so a
crash at any point resumes consistently: the checkpoint says which version exists, which batch
produced it and which earlier batches were trained without a confirmed ack; re-publishing an
existing version is idempotent and every one of those batches is acked then (acking twice is
harmless, forgetting one would have the coordinator re-deliver a trained batch).
`capture` copies the state off the live tensors (to CPU), so that the trainer's outbox can write
it (`Checkpointer.write`) while the next version trains, ahead of that version's publication.
A trainer of several ranks writes sharded checkpoints instead (`sharded_checkpoint.py`, whose
`open_checkpointer` picks the one for the number of ranks).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from decentrl.trainer.master_weights import MasterWeights
from decentrl.weights.chunks import _fsync_dir
from decentrl.weights.unique_storage import state_for_publication


@dataclass
class TrainerState:
    policy_version: int
    batch_id: str | None
    """The batch that produced `policy_version` (None for the initial weights)."""
    unacked: list[tuple[int, str]] = field(default_factory=list)
    """(version, batch id) of the earlier versions whose ack was not confirmed when this state
    was captured (the outbox acks a version while the next ones train): a resume acks them too."""

    def __post_init__(self) -> None:
        self.unacked = [(int(version), str(batch_id)) for version, batch_id in self.unacked]  # JSON: lists


@dataclass
class CheckpointData:
    """A trainer's state at one version, copied off its live tensors."""

    tensors: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    state: TrainerState


def capture(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainerState,
    master: MasterWeights | None = None,
) -> CheckpointData:
    """Copies (on CPU) of what `Checkpointer.write` stores: training may go on meanwhile."""
    tensors = state_for_publication(model)
    # bf16 training: the fp32 master weights replace their rounded copies, so a resume is exact.
    tensors.update(master.state() if master is not None else {})
    return CheckpointData(
        tensors=_copied(tensors),
        optimizer=_copied(optimizer.state_dict()),
        state=TrainerState(state.policy_version, state.batch_id, list(state.unacked)),
    )


def _copied(value: Any) -> Any:
    """`value` with every tensor in it copied to CPU (containers rebuilt, other leaves shared:
    an optimizer's state dict holds only numbers, strings and tuples besides its tensors)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copied(item) for item in value)
    return value


class Checkpointer:
    def __init__(self, directory: Path):
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)

    @property
    def _latest(self) -> Path:
        return self.directory / "latest"

    def exists(self) -> bool:
        # A crash between the two renames of `write` leaves only `previous`: still a checkpoint.
        return any((self.directory / name / "state.json").is_file() for name in ("latest", "previous"))

    def save(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state: TrainerState,
        master: MasterWeights | None = None,
    ) -> None:
        self.write(capture(model, optimizer, state, master))

    def commit(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state: TrainerState,
        master: MasterWeights | None = None,
    ) -> CheckpointData | None:
        """The checkpoint of a trained version, copied now and written by the outbox (`write`)
        ahead of the version's publication."""
        return capture(model, optimizer, state, master)

    def write(self, data: CheckpointData) -> None:
        staging = self.directory / f"staging-{os.getpid()}"
        staging.mkdir(exist_ok=True)
        save_file(data.tensors, str(staging / "model.safetensors"))
        torch.save(data.optimizer, staging / "optimizer.pt")
        (staging / "state.json").write_text(json.dumps(data.state.__dict__))
        for path in staging.iterdir():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        promote(staging)

    def load(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, master: MasterWeights | None = None
    ) -> TrainerState:
        source = self._latest if (self._latest / "state.json").is_file() else self.directory / "previous"
        tensors = load_file(str(source / "model.safetensors"))
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        # A tied head is stored once (under the embedding); any other mismatch is another model,
        # e.g. a full-parameter checkpoint resumed with lora.rank set, or the other way round.
        missing = [name for name in missing if not name.endswith("lm_head.weight")]
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {source} does not fit the model (missing {missing[:3]}, unexpected "
                f"{unexpected[:3]}); resume with the settings it was written with (model, lora)"
            )
        if master is not None:
            master.load_state(tensors)
        optimizer.load_state_dict(torch.load(source / "optimizer.pt", weights_only=True))
        return TrainerState(**json.loads((source / "state.json").read_text()))


def promote(staging: Path) -> None:
    """Make `staging` (its files written and fsynced) its parent's `latest`, durably: `latest`
    becomes `previous`, `staging` becomes `latest`, then `previous` goes. A rename is durable
    only once the directory holding it is fsynced: otherwise a power loss after the version was
    published could bring the older checkpoint back, and the resumed trainer would re-publish a
    version number that workers already hold with other weights."""
    directory = staging.parent
    latest, previous = directory / "latest", directory / "previous"
    _fsync_dir(staging)  # the files' entries
    if latest.exists():
        if previous.exists():
            shutil.rmtree(previous)
        latest.rename(previous)
    staging.rename(latest)
    _fsync_dir(directory)  # both renames, before anything relies on them
    if previous.exists():
        shutil.rmtree(previous)
