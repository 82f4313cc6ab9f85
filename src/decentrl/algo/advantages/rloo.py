"""RLOO advantages (Ahmadian et al., arXiv 2402.14740; docs/algorithm-reference.md §1.5)."""

from __future__ import annotations

import torch

from decentrl.algo.advantages import check_groups
from decentrl.algo.config import RLOOAdvantage


class RLOO:
    """Leave-one-out baseline: A_i = R_i - mean_{j != i} R_j = k/(k-1) (R_i - mean_j R_j).

    The baseline of each sample excludes that sample, so it is unbiased with k samples."""

    def __init__(self, config: RLOOAdvantage):
        del config  # no parameters

    def __call__(self, rewards: list[torch.Tensor]) -> list[torch.Tensor]:
        check_groups(rewards)
        out = []
        for group in rewards:
            k = group.numel()
            others_mean = (group.sum() - group) / (k - 1)
            out.append(group - others_mean)
        return out
