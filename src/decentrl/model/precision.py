"""Where and in which precision a model computes: `trainer.device` and `trainer.dtype` resolved.

The trainer, the verifier and held-out evaluation all compute with these settings, so what they
measure is the trained model as the trainer holds it. On an accelerator the default is bf16
(the trainer then keeps fp32 master weights, trainer/master_weights.py); on CPU it is fp32, since CPUs
gain little from bf16 matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decentrl.config import RunConfig, TrainerConfig
from decentrl.engines.hf import pick_device

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    device: torch.device
    dtype: torch.dtype
    """Dtype of the model's parameters; the optimizer always steps fp32 tensors."""

    @classmethod
    def from_config(cls, config: TrainerConfig, device: str | None = None) -> Precision:
        """`trainer.device` (or `device`) and `trainer.dtype` resolved."""
        picked = pick_device(device or config.device)
        if config.dtype == "auto":
            return cls(picked, torch.float32 if picked.type == "cpu" else torch.bfloat16)
        return cls(picked, DTYPES[config.dtype])

    @classmethod
    def for_evaluation(cls, config: RunConfig) -> Precision:
        """Held-out evaluation computes where and as the trainer does (`trainer.device`,
        `trainer.dtype`), so its accuracy is the trained model's; `eval.device` moves it elsewhere."""
        return cls.from_config(config.trainer, config.eval.device)
