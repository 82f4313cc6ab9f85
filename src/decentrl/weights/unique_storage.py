"""The model's tensors as published and checkpointed: each storage once."""

from __future__ import annotations

import torch


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
