"""A LoRA run on the vllm engine: the base as a model directory, each version's adapters as a
`peft` adapter directory that vLLM applies unmerged (its LoRA layers and punica kernels).

Merged into a bf16 weight, a small-lr update rounds back to the base (model/adapters.py); served
as an adapter it is kept. vLLM loads adapters only from disk, and cannot reload base weights in
place under its LoRA layers, so the base is written once and the engine starts from it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `max_lora_rank` values vLLM accepts (vllm/config/lora.py)."""


def rank_slot(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds adapters of `rank`."""
    for slot in MAX_LORA_RANKS:
        if slot >= rank:
            return slot
    raise ValueError(f"vLLM serves LoRA adapters up to rank {MAX_LORA_RANKS[-1]}, this run's are rank {rank}")


def write_base(model_dir: Path, base: dict[str, torch.Tensor], out: Path) -> Path:
    """`model_dir`'s config and tokenizer files with `base` as the weights, in `out`."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if (
            path.is_file()
            and path.suffix not in (".safetensors", ".bin")
            and not path.name.endswith(".index.json")
        ):
            shutil.copy(path, out / path.name)
    save_file({name: tensor.contiguous() for name, tensor in base.items()}, out / "model.safetensors")
    return out


def write_adapter(adapters: dict[str, torch.Tensor], out: Path) -> Path:
    """The published adapters (`X.lora_A`, `X.lora_B` with alpha / r folded into B) as a `peft`
    adapter directory: lora_alpha = r, so vLLM scales by 1."""
    from safetensors.torch import save_file

    (rank,) = {tensor.shape[0] for name, tensor in adapters.items() if name.endswith(".lora_A")}
    out.mkdir(parents=True, exist_ok=True)
    targets = sorted({name.rsplit(".", 2)[-2] for name in adapters})  # X = ...self_attn.q_proj
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": targets, "bias": "none"}
    (out / "adapter_config.json").write_text(json.dumps(config))
    tensors = {f"base_model.model.{name}.weight": tensor.contiguous() for name, tensor in adapters.items()}
    save_file(tensors, out / "adapter_model.safetensors")
    return out
