"""What every engine needs to know about a model directory before it loads weights into it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def expected_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of the model's state dict (built on the meta device: no memory)."""
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def load_eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """End-of-sequence ids from `config.json` (an int or a list), as the hf engine stops on them."""
    eos = json.loads((Path(model_dir) / "config.json").read_text()).get("eos_token_id")
    if eos is None:
        raise ValueError(f"{model_dir}/config.json has no eos_token_id; set it so generation can stop")
    return tuple(eos) if isinstance(eos, list) else (eos,)
