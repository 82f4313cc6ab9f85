"""The trainer's ranks: process group, FSDP2 sharding, the batch split, the gathers.

One process is the plain case (`Ranks.one`): every collective here is then a no-op, so the trainer
(`loop.py`) and its step (`step.py`) are one code path for any number of ranks.
Under `torchrun` every rank holds one shard of each parameter (`torch.distributed.fsdp.fully_shard`,
FSDP2: one flat shard per decoder layer, plus the root for embeddings and head). Rank 0 alone talks
to the coordinator; it broadcasts each batch of groups, every rank collates the whole batch (so the
global counts that normalise the loss are the same numbers the 1-process trainer uses) and trains
on its own contiguous slice of rows. Each rank's loss is then a partial sum of the 1-process loss,
so the gradients are *summed* across ranks (divide factor 1), not averaged: the update does not
depend on the number of ranks.

gloo on CPU (fp32), NCCL on CUDA with bf16 compute and fp32 gradient reduction (FSDP2's
`MixedPrecisionPolicy`; the sharded master weights and AdamW state stay fp32).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar, cast

import torch
import torch.distributed as dist

T = TypeVar("T")

COLLECTIVE_TIMEOUT = timedelta(minutes=30)
"""Longest wait of a rank in one collective; rank 0 broadcasts at least every `IDLE_BROADCAST_S`
while it waits for a batch, so only a hung rank reaches it."""


@dataclass(frozen=True)
class Ranks:
    """Who this process is among the trainer's ranks (torchtitan's `ParallelDims`, data-parallel only)."""

    rank: int
    world_size: int
    device: torch.device
    sharded: bool = True
    """In a process group (under torchrun, even of one rank): the policy is sharded with FSDP2 and
    every pass is a collective. False for the plain one-process trainer (`Ranks.one`) and for
    stage trainers (`stages > 1`)."""
    stages: int = 1
    """The pipeline dimension: with K > 1 the ranks are K stage trainers, rank s holding and
    training stage s of the policy (`pipeline_parallel.py`); every rank sees the whole batch."""

    @classmethod
    def one(cls, device: torch.device) -> Ranks:
        """A trainer of one process on `device`: no process group, every collective a no-op."""
        return cls(0, 1, device, sharded=False)

    @property
    def pipelined(self) -> bool:
        return self.stages > 1

    @property
    def in_group(self) -> bool:
        """Several processes train together: a batch must reach every rank."""
        return self.sharded or self.pipelined

    @property
    def data_parallel_size(self) -> int:
        """The ranks a mini-batch's rows are split over (stage trainers each see every row)."""
        return self.world_size // self.stages

    @property
    def is_main(self) -> bool:
        """Rank 0: the only one that talks to the coordinator, publishes, evaluates and logs."""
        return self.rank == 0


def init_process_group(stages: int = 1) -> Ranks:
    """NCCL on this rank's GPU when CUDA is present, else gloo on CPU. With `stages` > 1 the
    ranks are that many stage trainers (one per stage, no FSDP)."""
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
    world_size = dist.get_world_size()
    if stages > 1:
        if world_size != stages:
            raise ValueError(
                f"trainer.pipeline_stages = {stages} needs one rank per stage; torchrun started {world_size}"
            )
        return Ranks(dist.get_rank(), world_size, device, sharded=False, stages=stages)
    return Ranks(dist.get_rank(), world_size, device)


def close_process_group(clean: bool = True) -> None:
    """Leave the process group. On a clean exit every rank first waits for the others at a
    barrier, so none tears its gloo connections down while a peer still uses them (a rank that
    left while rank 0 was still writing its file was seen to abort in gloo's teardown:
    "terminate called without an active exception"). After an error there is no barrier: a
    failed peer would never reach it."""
    if not dist.is_initialized():
        return
    if clean:
        dist.barrier()
    dist.destroy_process_group()


def shard_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """FSDP2 over `model` in place: each decoder layer (the model's `_no_split_modules`, also under a
    `peft` wrapper) is one unit, the root holds the rest. Gradients are summed across ranks."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if device.type == "cuda"
        else MixedPrecisionPolicy()
    )
    model.to(device)
    layer_classes = set(getattr(_base_model(model), "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    assert layers, f"{type(_base_model(model)).__name__} names no decoder layers (_no_split_modules)"
    for unit in [*layers, model]:
        sharded = fully_shard(unit, mp_policy=policy)  # the module, now also an FSDPModule
        # Each rank's loss is already scaled by the global counts: sum the ranks' gradients
        # (divide factor 1), with a plain SUM reduce-scatter (gloo has no pre-multiplied sum).
        sharded.set_gradient_divide_factor(1.0)
        sharded.set_force_sum_reduction_for_comms(True)
    return model


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The `transformers` model under a `peft` wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if get_base is not None else model


def broadcast(value: T | None, ranks: Ranks) -> T:
    """Rank 0's `value` on every rank (the others pass None; pickled, a batch of groups is a few
    MB at most)."""
    if not ranks.in_group:
        return cast(T, value)
    box = [value if ranks.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return cast(T, box[0])


def row_slice(num_rows: int, ranks: Ranks) -> slice:
    """This rank's contiguous rows of the batch: sizes differ by at most one."""
    if not ranks.sharded:
        return slice(0, num_rows)
    if num_rows < ranks.world_size:
        raise ValueError(
            f"a batch of {num_rows} sequences cannot be split over {ranks.world_size} ranks; "
            "raise trainer.groups_per_step or lower trainer.nproc"
        )
    base, extra = divmod(num_rows, ranks.world_size)
    start = ranks.rank * base + min(ranks.rank, extra)
    return slice(start, start + base + (ranks.rank < extra))


def sum_rows(rows_bt: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """Each rank filled its own rows (zeros elsewhere): the whole tensor on every rank."""
    if not ranks.sharded:
        return rows_bt
    summed = rows_bt.to(ranks.device)
    dist.all_reduce(summed)
    return summed.cpu()


def sum_over_ranks(sums: dict[str, float], ranks: Ranks) -> dict[str, float]:
    """Each rank's partial sums, summed over the ranks (every rank gets them; same keys on every rank)."""
    if not ranks.sharded:
        return sums
    names = sorted(sums)
    values = torch.tensor([sums[n] for n in names], dtype=torch.float64, device=ranks.device)
    dist.all_reduce(values)  # NCCL reduces only device tensors, gloo CPU ones: ranks.device is both
    return dict(zip(names, values.tolist(), strict=True))


def full_state(model: torch.nn.Module, names: list[str], ranks: Ranks) -> dict[str, torch.Tensor]:
    """The unsharded fp32 tensors `names` on rank 0 (empty dict elsewhere), gathered with the
    distributed state-dict API; a collective, so every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not ranks.is_main:
        return {}
    return {name: cast(torch.Tensor, state[name]).detach().float().contiguous() for name in names}
