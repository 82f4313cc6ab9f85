"""Dr. GRPO advantages (Liu et al., arXiv 2503.20783; docs/algorithm-reference.md §1.3).

Dividing by the group std up-weights prompts that are almost always solved or almost never
(difficulty bias); Dr. GRPO keeps only the mean baseline. The paper's other change, no per-response
length normalisation, is `AlgorithmConfig.aggregation = "constant"`.
"""

from __future__ import annotations

import torch

from decentrl.algo.advantages import centred, check_groups
from decentrl.config.algorithm import DrGRPOAdvantage


class DrGRPO:
    """A_i = R_i - mean_j R_j within each group."""

    def __init__(self, config: DrGRPOAdvantage):
        del config  # no parameters

    def __call__(self, rewards: list[torch.Tensor]) -> list[torch.Tensor]:
        check_groups(rewards)
        return [centred(group).to(group.dtype) for group in rewards]
