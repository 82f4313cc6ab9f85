"""What every engine needs to know about a model directory before it loads weights into it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM


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
    """End-of-sequence ids from `config.json` (an int or a list), as the hf engine stops on them."""
    eos = json.loads((Path(model_dir) / "config.json").read_text()).get("eos_token_id")
    if eos is None:
        raise ValueError(f"{model_dir}/config.json has no eos_token_id; set it so generation can stop")
    return tuple(eos) if isinstance(eos, list) else (eos,)
