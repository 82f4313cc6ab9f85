"""Fixtures shared by the unit tests of LoRA training and of adapters served unmerged."""

from __future__ import annotations

import pytest
import torch

from decentrl.config import LoraConfig, ModelConfig
from decentrl.model import lora
from decentrl.model.tiny import build_tiny


@pytest.fixture
def adapted():
    """A tiny model with rank-2 adapters whose B is non-zero (as after some training)."""
    model, _ = build_tiny(ModelConfig())
    peft_model = lora.attach(model, LoraConfig(rank=2, alpha=8.0))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.05 * torch.randn(parameter.shape, generator=generator))
    return peft_model.eval()
