"""Full safetensors snapshots of a model's weights, the unit the trainer publishes per version."""

from __future__ import annotations

import torch
from safetensors.torch import load, save


def state_for_publication(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors, each stored once: a tied `lm_head.weight` shares the embedding's
    storage and is left out (safetensors refuses shared storage; engines re-tie it)."""
    seen: set[int] = set()
    state = {}
    for name, tensor in model.state_dict().items():
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in seen:
            continue
        seen.add(pointer)
        state[name] = tensor.detach().contiguous().cpu()
    return state


def serialize(model: torch.nn.Module) -> bytes:
    return save(state_for_publication(model))


def deserialize(blob: bytes) -> dict[str, torch.Tensor]:
    return load(blob)
