"""Decoupled PPO loss (Hilton et al., arXiv 2110.00641; AReaL, arXiv 2505.24298).

Three policies (../shared/reference/algorithms.md §0, §2.2):
  mu      behaviour: the worker's per-token sampling log-probs (possibly stale versions),
  pi_prox proximal: recomputed by the trainer with its weights at the start of the step,
  pi      the policy being optimised.
Per token: w = min(pi_prox / mu, is_cap) (a constant), u = pi / pi_prox, and
  l = -w * min(u A, clip(u, 1 - eps, 1 + eps) A),
summed over loss tokens and divided by the *global* count of loss tokens of the batch
(token-mean, §4.5), so splitting a batch into micro-batches does not change the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOG_RATIO_LIMIT = 20.0  # verl clamps log-ratios to ±20 before exp (§1.1)


@dataclass
class LossOutput:
    loss: torch.Tensor
    """Sum over this micro-batch's loss tokens / global token count (add micro-batches up)."""
    stats: dict[str, float]


def decoupled_ppo_loss(
    logprobs_bt: torch.Tensor,
    proximal_logprobs_bt: torch.Tensor,
    behaviour_logprobs_bt: torch.Tensor,
    advantages_bt: torch.Tensor,
    loss_mask_bt: torch.Tensor,
    num_loss_tokens: int,
    clip_eps: float,
    is_cap: float,
) -> LossOutput:
    mask = loss_mask_bt.to(logprobs_bt.dtype)
    log_ratio = (logprobs_bt - proximal_logprobs_bt.detach()).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = log_ratio.exp()
    log_behaviour_weight = (proximal_logprobs_bt - behaviour_logprobs_bt).detach()
    behaviour_weight = log_behaviour_weight.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp().clamp(max=is_cap)
    unclipped = ratio * advantages_bt
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages_bt
    per_token = -behaviour_weight * torch.minimum(unclipped, clipped)
    loss = (per_token * mask).sum() / num_loss_tokens
    with torch.no_grad():
        count = mask.sum().clamp(min=1)
        is_clipped = (clipped < unclipped).to(mask.dtype)  # the min took the clipped branch
        stats = {
            "clip_fraction": float((is_clipped * mask).sum() / count),
            "is_weight_mean": float((behaviour_weight * mask).sum() / count),
            "is_weight_max": float((behaviour_weight * mask).max()),
            "is_truncated_fraction": float(((log_behaviour_weight.exp() > is_cap) * mask).sum() / count),
            # k3 estimate of KL(mu || pi_prox) on the sampled tokens (prime-rl's mismatch_kl)
            "mismatch_kl": float(
                ((log_behaviour_weight.exp() - 1 - log_behaviour_weight) * mask).sum() / count
            ),
        }
    return LossOutput(loss=loss, stats=stats)
