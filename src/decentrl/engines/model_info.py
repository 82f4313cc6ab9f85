"""What every engine needs to know about a model directory before it loads weights into it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from decentrl.model.special import read_eos_token_ids


@dataclass
class StateLayout:
    shapes: dict[str, tuple[int, ...]]
    """Every tensor of the model's state dict and its shape."""
    tied: dict[str, str]
    """Tensors that are another one (tied embeddings: `lm_head.weight` -> `model.embed_tokens.weight`)."""


def state_layout(model_dir: str | Path) -> StateLayout:
    """The model's state-dict names, shapes and ties, built on the meta device (no memory)."""
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    state = model.state_dict(keep_vars=True)
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, tensor in state.items():
        if id(tensor) in first:
            tied[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
    return StateLayout({name: tuple(tensor.shape) for name, tensor in state.items()}, tied)


def load_eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """Every id that ends a generation (config.json and generation_config.json), as the hf engine,
    the coordinator's stop check and the chat formats read them."""
    return tuple(read_eos_token_ids(Path(model_dir)))
