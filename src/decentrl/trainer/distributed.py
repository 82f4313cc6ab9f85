"""The pieces of a multi-rank trainer: process group, FSDP2 sharding, the batch split, the gathers.

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

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(minutes=30)
"""Longest wait of a rank in one collective; rank 0 broadcasts at least every `IDLE_BROADCAST_S`
while it waits for a batch, so only a hung rank reaches it."""

ADDITIVE_METRICS = ("loss", "policy_loss", "kl_reference")
"""Step metrics that are sums over tokens (each rank holds a partial sum); the rest are averaged."""


@dataclass(frozen=True)
class Ranks:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_process_group() -> Ranks:
    """NCCL on this rank's GPU when CUDA is present, else gloo on CPU."""
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
    return Ranks(dist.get_rank(), dist.get_world_size(), device)


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
        fully_shard(unit, mp_policy=policy)
        # Each rank's loss is already scaled by the global counts: sum the ranks' gradients
        # (divide factor 1), with a plain SUM reduce-scatter (gloo has no pre-multiplied sum).
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return model


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The `transformers` model under a `peft` wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if get_base is not None else model


def broadcast(value: object, ranks: Ranks) -> object:
    """Rank 0's `value` on every rank (pickled; a batch of groups is a few MB at most)."""
    box = [value if ranks.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def row_slice(num_rows: int, ranks: Ranks) -> slice:
    """This rank's contiguous rows of the batch: sizes differ by at most one."""
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
    summed = rows_bt.to(ranks.device)
    dist.all_reduce(summed)
    return summed.cpu()


def reduce_metrics(metrics: dict[str, float], ranks: Ranks) -> dict[str, float]:
    """Sum the additive step metrics over ranks and average the others (every rank gets them)."""
    names = sorted(metrics)
    values = torch.tensor([metrics[n] for n in names], dtype=torch.float64, device=ranks.device)
    dist.all_reduce(values)  # NCCL reduces only device tensors, gloo CPU ones: ranks.device is both
    return {
        name: float(value) if name in ADDITIVE_METRICS else float(value) / ranks.world_size
        for name, value in zip(names, values.tolist(), strict=True)
    }


def full_state(model: torch.nn.Module, names: list[str], ranks: Ranks) -> dict[str, torch.Tensor]:
    """The unsharded fp32 tensors `names` on rank 0 (empty dict elsewhere), gathered with the
    distributed state-dict API; a collective, so every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not ranks.is_main:
        return {}
    return {name: state[name].detach().float().contiguous() for name in names}
