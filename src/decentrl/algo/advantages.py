"""Advantage estimation over groups of samples of the same prompt."""

from __future__ import annotations

import torch


def grpo_advantages(rewards_g: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO (arXiv 2402.03300): A_i = (R_i - mean_j R_j) / (std_j R_j + eps) within one group.

    std is the unbiased sample std, as torch.std (verl, TRL) computes it. A group of identical
    rewards gets all-zero advantages (no signal, no NaN).
    """
    assert rewards_g.dim() == 1 and rewards_g.numel() >= 2, "a group needs at least two samples"
    centred = rewards_g - rewards_g.mean()
    return centred / (rewards_g.std() + eps)
