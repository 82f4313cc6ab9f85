"""Advantage estimators: one file each, all with the same call signature.

An estimator takes the trusted rewards of every group of a batch (one 1-D tensor per group, the
samples of one prompt) and returns one advantage per sample, in the same layout. Each response's
advantage is broadcast to all its loss tokens by the trainer (outcome rewards, gamma = 1).
"""

from __future__ import annotations

from typing import Protocol

import torch


class AdvantageEstimator(Protocol):
    def __call__(self, rewards: list[torch.Tensor]) -> list[torch.Tensor]: ...


def check_groups(rewards: list[torch.Tensor]) -> None:
    for group in rewards:
        assert group.dim() == 1 and group.numel() >= 2, "a group needs at least two samples"
