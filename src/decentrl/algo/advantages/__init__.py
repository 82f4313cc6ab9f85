"""Advantage estimators: one file each, all with the same call signature.

An estimator takes the trusted rewards of every group of a batch (one 1-D tensor per group, the
samples of one prompt) and returns one advantage per sample, in the same layout. Each response's
advantage is broadcast to all its loss tokens by the trainer (outcome rewards, gamma = 1).

Every estimator computes in float64 and gives exact zeros to rewards that are all equal. In
float32 the mean of eight copies of 1.2 lands one ulp off and the std is about one ulp, so a
saturated group would otherwise get A = +0.106 on every sample: a push in one direction from a
group that carries no signal.
"""

from __future__ import annotations

from typing import Protocol

import torch


class AdvantageEstimator(Protocol):
    def __call__(self, rewards: list[torch.Tensor]) -> list[torch.Tensor]: ...


def check_groups(rewards: list[torch.Tensor]) -> None:
    for group in rewards:
        assert group.dim() == 1 and group.numel() >= 2, "a group needs at least two samples"


def centred(values: torch.Tensor) -> torch.Tensor:
    """values - mean(values) in float64; exact zeros when all values are equal."""
    values = values.double()
    if values.max() == values.min():
        return torch.zeros_like(values)
    return values - values.mean()


def standardised(values: torch.Tensor, eps: float) -> torch.Tensor:
    """(values - mean) / (unbiased std + eps) in float64; exact zeros when all values are equal."""
    deviations = centred(values)
    return deviations / (values.double().std() + eps)
