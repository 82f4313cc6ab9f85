"""Policy losses: one file each, all with the same call signature.

A loss gets the current log-probs (with gradient), the trust-region anchor the off-policy
correction chose (pi_prox, or mu for naive PPO), the correction's per-token weights (0 = rejected),
advantages broadcast to tokens, and `token_scale_bt`: the aggregation's per-token factor, already
divided by a *global* denominator (see `algo/aggregation.py`). The loss is
sum(per_token_loss * weight * token_scale), so micro-batches add up to the full batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

LOG_RATIO_LIMIT = 20.0  # verl clamps log-ratios to ±20 before exp (§1.1)


@dataclass
class LossInputs:
    logprobs_bt: torch.Tensor
    """log pi_theta of each token, with gradient."""
    anchor_logprobs_bt: torch.Tensor
    """The policy the ratio is taken against (detached)."""
    weights_bt: torch.Tensor
    """Off-policy correction weight per token (detached; 0 for rejected tokens)."""
    advantages_bt: torch.Tensor
    loss_mask_bt: torch.Tensor
    """True on tokens the policy sampled (prompt, env tokens and padding are False)."""
    token_scale_bt: torch.Tensor
    """Aggregation factor per token, zero off the mask (see algo/aggregation.py)."""


@dataclass
class LossOutput:
    loss: torch.Tensor
    """Sum over this micro-batch's tokens with the global aggregation (add micro-batches up)."""
    stats: dict[str, float]


class PolicyLoss(Protocol):
    filters_groups: bool
    """Ask the coordinator for groups whose rewards are not all equal (DAPO dynamic sampling)."""

    def __call__(self, inputs: LossInputs) -> LossOutput: ...

    def shape_rewards(
        self, rewards_b: torch.Tensor, lengths_b: torch.Tensor, max_new_tokens: int
    ) -> torch.Tensor:
        """Reward shaping applied by the trainer before advantages (identity for most losses)."""
        ...


def log_ratio(inputs: LossInputs) -> torch.Tensor:
    """log(pi_theta / anchor), clamped so exp cannot overflow."""
    return (inputs.logprobs_bt - inputs.anchor_logprobs_bt.detach()).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def masked_fraction(flags_bt: torch.Tensor, mask_bt: torch.Tensor) -> float:
    mask = mask_bt.to(torch.float32)
    return float((flags_bt.to(torch.float32) * mask).sum() / mask.sum().clamp(min=1))


class NoShaping:
    filters_groups = False

    def shape_rewards(
        self, rewards_b: torch.Tensor, lengths_b: torch.Tensor, max_new_tokens: int
    ) -> torch.Tensor:
        return rewards_b
