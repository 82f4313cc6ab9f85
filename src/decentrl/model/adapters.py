"""Published LoRA adapters served unmerged, and how far a served model is from the trainer's.

A bf16 engine that holds the merged weight W0 + B @ A rounds every element to its bf16 grid. An
update smaller than half a bf16 step of the weight (most of a small-lr LoRA update: the base
weights are ~0.02-0.1, a bf16 step there is 1e-4-4e-4) rounds back to W0, so the worker keeps
sampling from the base while the trainer's fp32 model moves. Served unmerged, y = x W0^T +
(x A^T) B^T, the update lives in A and B at their own precision (bf16 keeps 8 bits of each, so the
update arrives to ~0.5 %), and only the layer's output is rounded: an unbiased rounding of a value
that does include the update.

`serve` turns a plain `transformers` model into one whose `state_dict` has exactly the published
layout (`X.weight`, `X.lora_A`, `X.lora_B` per adapted layer, `model/lora.py`), so the hf engine,
the verifier and the evaluation load a published state, or a delta's tensors, as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class AdaptedLinear(torch.nn.Linear):
    """A linear layer plus its published adapter, unmerged (B carries the scaling alpha / r)."""

    def __init__(self, linear: torch.nn.Linear, rank: int):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight = linear.weight  # the same parameters: nothing is copied
        self.bias = linear.bias
        like = {"dtype": linear.weight.dtype, "device": linear.weight.device}
        self.lora_A = torch.nn.Parameter(torch.zeros(rank, self.in_features, **like), requires_grad=False)
        self.lora_B = torch.nn.Parameter(torch.zeros(self.out_features, rank, **like), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + F.linear(F.linear(x, self.lora_A), self.lora_B)


def serve(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Give every layer `tensors` names an `X.lora_A` for an adapter of that rank (zero until
    loaded), so that `tensors` then load into `model` by name. Layers already adapted stay."""
    for name, tensor in tensors.items():
        if not name.endswith(".lora_A"):
            continue
        path = name.removesuffix(".lora_A")
        try:
            layer = model.get_submodule(path)
        except AttributeError:
            raise ValueError(f"weights do not match the model: {name} names no layer of it") from None
        if isinstance(layer, AdaptedLinear) and layer.lora_A.shape == tensor.shape:
            continue
        if type(layer) not in (torch.nn.Linear, AdaptedLinear):
            raise ValueError(
                f"{path}: adapters are served on torch.nn.Linear layers, not {type(layer).__name__}"
            )
        assert isinstance(layer, torch.nn.Linear)  # a Linear or an AdaptedLinear, checked above
        parent, _, child = path.rpartition(".")
        model.get_submodule(parent).register_module(child, AdaptedLinear(layer, tensor.shape[0]))


@torch.no_grad()
def effective_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every linear weight as the model computes with it, in float32: W, or W + B @ A for an
    adapted layer (the adapter path's own activation rounding aside)."""
    out = {}
    for path, layer in model.named_modules():
        if isinstance(layer, AdaptedLinear):
            out[f"{path}.weight"] = torch.addmm(
                layer.weight.float(), layer.lora_B.float(), layer.lora_A.float()
            )
        elif isinstance(layer, torch.nn.Linear):
            out[f"{path}.weight"] = layer.weight.detach().float()
    return out


def update_error(
    trainer_now: dict[str, torch.Tensor],
    trainer_start: dict[str, torch.Tensor],
    served_now: dict[str, torch.Tensor],
    served_start: dict[str, torch.Tensor],
) -> float:
    """||served update - trainer update|| / ||trainer update|| over the weights `trainer_now`
    names (each an update since its own start): 0 when a worker computes with exactly the update
    the trainer made, 1 when it still computes with the start."""
    wrong = total = 0.0
    for name, now in trainer_now.items():
        update = now.float() - trainer_start[name].float()
        served = served_now[name].float() - served_start[name].float()
        wrong += float((served - update).square().sum())
        total += float(update.square().sum())
    assert total > 0, "the trainer's weights have not moved: there is no update to compare"
    return (wrong / total) ** 0.5
