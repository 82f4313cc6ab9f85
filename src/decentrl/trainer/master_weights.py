"""The trainer's master weights: what the optimizer steps when the parameters are in bf16.

On an accelerator the default is bf16 parameters (forward, backward, activations and gradients
in bf16, half the memory of fp32) with an fp32 master copy of every trainable parameter that
the optimizer steps, so AdamW's moments and the small per-step updates are not rounded away in
bf16 (Micikevicius et al., "Mixed Precision Training", arXiv 1710.03740). After each step the
master copy is cast back into the bf16 parameters. On CPU the default is plain fp32: CPUs gain
little from bf16 matmuls and the master copy would only add memory.
"""

from __future__ import annotations

import torch


class MasterWeights:
    """The tensors the optimizer steps: the trainable parameters themselves in fp32, or fp32
    copies of them (the master weights) when the parameters are in a lower precision."""

    def __init__(self, model: torch.nn.Module):
        self.named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.separate = any(p.dtype != torch.float32 for _, p in self.named)
        if self.separate:
            self.master = [torch.nn.Parameter(p.detach().float().clone()) for _, p in self.named]
        else:
            self.master = [p for _, p in self.named]

    def parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps (and the gradient norm is clipped over)."""
        return self.master

    def accumulate_gradients(self) -> None:
        """Add the gradients of the last backward pass (one micro-batch) onto the master copies,
        in fp32, and free the model's. Summed in bf16 over a mini-batch's micro-batches instead,
        every addition would round to bf16's 8-bit mantissa and the later micro-batches' smaller
        contributions would be partly lost."""
        if not self.separate:
            return
        for (_, param), master in zip(self.named, self.master, strict=True):
            if param.grad is None:
                continue
            gradient = param.grad.float()
            master.grad = gradient if master.grad is None else master.grad.add_(gradient)
            param.grad = None

    @torch.no_grad()
    def master_to_model(self) -> None:
        """Cast the stepped master weights back into the model's parameters."""
        if not self.separate:
            return
        for (_, param), master in zip(self.named, self.master, strict=True):
            param.copy_(master)

    def state(self) -> dict[str, torch.Tensor]:
        """The fp32 master tensors by parameter name (what a checkpoint keeps; empty without copies)."""
        if not self.separate:
            return {}
        return {
            name: master.detach().cpu() for (name, _), master in zip(self.named, self.master, strict=True)
        }

    @torch.no_grad()
    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore master copies from a checkpoint's fp32 tensors (exact resume in bf16)."""
        for (name, _), master in zip(self.named, self.master, strict=True):
            if self.separate and name in tensors:
                master.copy_(tensors[name])
        self.master_to_model()
