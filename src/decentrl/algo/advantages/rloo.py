"""RLOO advantages (Ahmadian et al., arXiv 2402.14740; docs/algorithm-reference.md §1.5)."""

from __future__ import annotations

import torch

from decentrl.algo.advantages import centred, check_groups
from decentrl.config.algorithm import RLOOAdvantage


class RLOO:
    """Leave-one-out baseline: A_i = R_i - mean_{j != i} R_j = k/(k-1) (R_i - mean_j R_j).

    The baseline of each sample excludes that sample, so it is unbiased with k samples."""

    def __init__(self, config: RLOOAdvantage):
        del config  # no parameters

    def __call__(self, rewards: list[torch.Tensor]) -> list[torch.Tensor]:
        check_groups(rewards)
        # R_i - (sum_j R_j - R_i) / (k - 1) rearranges to k/(k-1) (R_i - mean_j R_j); the centred
        # form keeps a saturated group at exact zeros.
        return [(centred(group) * (group.numel() / (group.numel() - 1))).to(group.dtype) for group in rewards]
