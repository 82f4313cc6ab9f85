"""GRPO advantages (DeepSeekMath, arXiv 2402.03300; docs/algorithm-reference.md §1.2)."""

from __future__ import annotations

import torch

from decentrl.algo.advantages import check_groups, standardised
from decentrl.config.algorithm import GRPOAdvantage


class GRPO:
    """A_i = (R_i - mean_j R_j) / (std_j R_j + eps) within each group.

    std is the unbiased sample std, as torch.std (verl, TRL) computes it. A group of identical
    rewards gets exact zeros (no signal, no NaN, no rounding push)."""

    def __init__(self, config: GRPOAdvantage):
        self.eps = config.eps

    def __call__(self, rewards: list[torch.Tensor]) -> list[torch.Tensor]:
        check_groups(rewards)
        return [standardised(group, self.eps).to(group.dtype) for group in rewards]
