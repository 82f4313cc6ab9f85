"""PPO clipped surrogate at token level (Schulman et al., arXiv 1707.06347), optional dual clip
(Ye et al. 2020; INTELLECT-2's two-sided clipping, arXiv 2505.07291). See
docs/algorithm-reference.md §1.1 and §2.5.
"""

from __future__ import annotations

import torch

from decentrl.algo.losses import LossInputs, LossOutput, NoShaping, log_ratio, masked_fraction
from decentrl.config.algorithm import PPOClipLoss


def clipped_surrogate(
    ratio_bt: torch.Tensor,
    advantages_bt: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss -min(r A, clip(r, 1-eps_low, 1+eps_high) A), and where the clip was active.

    With `dual_clip` = c, a negative-advantage token's loss is further capped at c·|A|: the
    unclipped branch of a token whose ratio exploded would otherwise dominate the batch."""
    unclipped = ratio_bt * advantages_bt
    clipped = ratio_bt.clamp(1 - eps_low, 1 + eps_high) * advantages_bt
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = clipped < unclipped  # the min took the clipped (constant) branch: no gradient
    if dual_clip is not None:
        capped = (advantages_bt < 0) & (loss > dual_clip * -advantages_bt)
        loss = torch.where(capped, dual_clip * -advantages_bt, loss)
        was_clipped = was_clipped | capped
    return loss, was_clipped


def ppo_clip_loss(
    inputs: LossInputs, eps_low: float, eps_high: float, dual_clip: float | None = None
) -> LossOutput:
    ratio = log_ratio(inputs).exp()
    per_token, was_clipped = clipped_surrogate(ratio, inputs.advantages_bt, eps_low, eps_high, dual_clip)
    loss = (per_token * inputs.weights_bt * inputs.token_scale_bt).sum()
    return LossOutput(loss, {"clip_fraction": masked_fraction(was_clipped, inputs.loss_mask_bt)})


class PPOClip(NoShaping):
    def __init__(self, config: PPOClipLoss):
        self.config = config

    def __call__(self, inputs: LossInputs) -> LossOutput:
        return ppo_clip_loss(inputs, self.config.eps_low, self.config.eps_high, self.config.dual_clip)
