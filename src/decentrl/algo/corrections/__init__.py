"""Off-policy corrections for stale and engine-mismatched rollouts: one file each.

Three policies (docs/algorithm-reference.md §0): mu samples on a worker (possibly versions
behind, possibly other kernels), pi_prox is the trainer's policy at the start of the step (its
log-probs recomputed by the trainer), pi_theta is being optimised. A correction decides, from
rho = pi_prox / mu on each loss token (M2PO also from the advantage's sign), two things the
loss then uses:
- the anchor of the trust-region ratio (pi_prox, or mu for naive PPO), and
- a detached per-token weight, 0 on rejected tokens.
Rejected tokens stay in the aggregation's denominator, as AReaL keeps the pre-mask count, so
survivors are not up-weighted (§4.5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from decentrl.algo.losses import LOG_RATIO_LIMIT


@dataclass
class Correction:
    anchor_logprobs_bt: torch.Tensor
    weights_bt: torch.Tensor
    stats: dict[str, float]


class OffPolicyCorrection(Protocol):
    def __call__(
        self,
        proximal_bt: torch.Tensor,
        behaviour_bt: torch.Tensor,
        loss_mask_bt: torch.Tensor,
        advantages_bt: torch.Tensor,
    ) -> Correction: ...


def token_log_rho(
    proximal_bt: torch.Tensor, behaviour_bt: torch.Tensor, loss_mask_bt: torch.Tensor
) -> torch.Tensor:
    """log(pi_prox / mu) per token, 0 off the loss mask, clamped so exp cannot overflow."""
    log_rho = (proximal_bt - behaviour_bt).detach().clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.where(loss_mask_bt, log_rho, torch.zeros_like(log_rho))


def sequence_log_rho(
    proximal_bt: torch.Tensor, behaviour_bt: torch.Tensor, loss_mask_bt: torch.Tensor
) -> torch.Tensor:
    """log of the product of rho over each row's loss tokens, broadcast back to the row's tokens."""
    summed_b = token_log_rho(proximal_bt, behaviour_bt, loss_mask_bt).sum(-1, keepdim=True)
    return summed_b.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).expand_as(proximal_bt)


def weight_stats(weights_bt: torch.Tensor, loss_mask_bt: torch.Tensor) -> dict[str, float]:
    """Mean/max weight, the rejected fraction, and the effective sample size (sum w)^2 / sum w^2
    as a fraction of the loss tokens (1 = all tokens count fully; §4.3)."""
    w = weights_bt[loss_mask_bt].to(torch.float64)
    if w.numel() == 0:
        return {
            "is_weight_mean": 1.0,
            "is_weight_max": 1.0,
            "is_ess_fraction": 1.0,
            "is_rejected_fraction": 0.0,
        }
    ess = float(w.sum() ** 2 / (w.numel() * (w**2).sum())) if bool((w > 0).any()) else 0.0
    return {
        "is_weight_mean": float(w.mean()),
        "is_weight_max": float(w.max()),
        "is_ess_fraction": ess,
        "is_rejected_fraction": float((w == 0).to(torch.float64).mean()),
    }


def rejection_stats(
    weights_bt: torch.Tensor,
    log_rho_bt: torch.Tensor,
    advantages_bt: torch.Tensor,
    loss_mask_bt: torch.Tensor,
) -> dict[str, float]:
    """What a correction's rejections (weight 0) took out of the learning signal.

    - `is_rejected_advantage_share`: the rejected tokens' share of the loss tokens' total |A|.
      Tokens with A = 0 carry no gradient, so this is the part of the signal removed, which can
      be far larger than the rejected fraction of tokens.
    - `is_rejected_corrective_fraction`: of the rejected tokens with A != 0, the fraction whose
      probability moved against their advantage since sampling (A · log rho < 0: a good token
      that became less likely, a bad one that became more likely). Their gradient would pull a
      drifted policy back; a clip never stops such a token (the min keeps its unclipped branch).
    """
    mask = loss_mask_bt & (weights_bt == 0)
    magnitude = advantages_bt.abs()
    total = float(magnitude[loss_mask_bt].sum())
    informative = mask & (advantages_bt != 0)
    corrective = informative & (advantages_bt * log_rho_bt < 0)
    return {
        "is_rejected_advantage_share": float(magnitude[mask].sum()) / total if total > 0 else 0.0,
        "is_rejected_corrective_fraction": (
            float(corrective.sum()) / float(informative.sum()) if bool(informative.any()) else 0.0
        ),
    }


def mismatch_kl(proximal_bt: torch.Tensor, behaviour_bt: torch.Tensor, loss_mask_bt: torch.Tensor) -> float:
    """k3 estimate of KL(mu || pi_prox) on the sampled tokens: mean(rho - 1 - log rho) (prime-rl's
    `mismatch_kl`, §4.3). Grows with staleness and with engine/trainer numeric mismatch."""
    log_rho = token_log_rho(proximal_bt, behaviour_bt, loss_mask_bt)
    k3 = log_rho.exp() - 1 - log_rho
    return float(k3[loss_mask_bt].mean()) if bool(loss_mask_bt.any()) else 0.0


def make_correction(
    anchor_bt: torch.Tensor, weights_bt: torch.Tensor, loss_mask_bt: torch.Tensor
) -> Correction:
    weights_bt = weights_bt.detach()
    return Correction(anchor_bt.detach(), weights_bt, weight_stats(weights_bt, loss_mask_bt))
