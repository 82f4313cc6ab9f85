"""DAPO (Yu et al., arXiv 2503.14476; docs/algorithm-reference.md §1.4).

Four changes over GRPO, all here or switched on from here:
- clip-higher: eps_high (0.28) > eps_low (0.2) leaves room for rare tokens to grow;
- token-level aggregation: the trainer's default `aggregation = "token_mean"` over the global batch;
- dynamic sampling: `filters_groups` asks the coordinator to skip groups whose rewards are all
  equal (A = 0 everywhere, yet they dilute the token denominator) and to wait for enough others;
- overlong reward shaping: a soft length penalty added to the correctness reward.
"""

from __future__ import annotations

import torch

from decentrl.algo.losses import LossInputs, LossOutput
from decentrl.algo.losses.ppo_clip import ppo_clip_loss
from decentrl.config.algorithm import DAPOLoss


def overlong_penalty(
    lengths_b: torch.Tensor, max_tokens: int, buffer_tokens: int, penalty: float
) -> torch.Tensor:
    """R_len: 0 up to max_tokens - buffer, then linear down to -penalty at max_tokens (and beyond)."""
    if buffer_tokens == 0:
        return torch.zeros_like(lengths_b, dtype=torch.float32)
    free = max_tokens - buffer_tokens
    over = (lengths_b.to(torch.float32) - free).clamp(min=0) / buffer_tokens
    return -penalty * over.clamp(max=1.0)


class DAPO:
    def __init__(self, config: DAPOLoss):
        self.config = config
        self.filters_groups = config.dynamic_sampling

    def __call__(self, inputs: LossInputs) -> LossOutput:
        return ppo_clip_loss(inputs, self.config.eps_low, self.config.eps_high)

    def shape_rewards(
        self, rewards_b: torch.Tensor, lengths_b: torch.Tensor, max_new_tokens: int
    ) -> torch.Tensor:
        penalty = overlong_penalty(
            lengths_b, max_new_tokens, self.config.overlong_buffer_tokens, self.config.overlong_penalty
        )
        return rewards_b + penalty
