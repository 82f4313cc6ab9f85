"""REINFORCE++ advantages (Hu et al., arXiv 2501.03262; docs/algorithm-reference.md §1.6).

With outcome rewards, gamma = 1 and the KL kept out of the reward (decentrl puts it in the loss),
every token's return equals the response's reward, so the token-level return G_t is R_i.
Decision (the reference leaves it open): the global normalisation is over the batch's responses,
not its tokens; OpenRLHF whitens over tokens, which also weights long responses more.
"""

from __future__ import annotations

import torch

from decentrl.algo.advantages import centred, check_groups, standardised
from decentrl.config.algorithm import ReinforcePPAdvantage


class ReinforcePP:
    """A = (G - mean_batch G) / (std_batch G + eps); with `baseline`, G = R - group mean first
    (REINFORCE++-baseline), so the batch std scales group-centred returns."""

    def __init__(self, config: ReinforcePPAdvantage):
        self.baseline = config.baseline
        self.eps = config.eps

    def __call__(self, rewards: list[torch.Tensor]) -> list[torch.Tensor]:
        check_groups(rewards)
        returns = [centred(group) for group in rewards] if self.baseline else rewards
        normalised = standardised(torch.cat(returns), self.eps).to(rewards[0].dtype)
        return list(normalised.split([group.numel() for group in rewards]))
