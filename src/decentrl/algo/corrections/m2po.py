"""M2PO, second-moment trust policy optimisation (Zheng, Zhao, Chen, arXiv 2510.01161;
docs/algorithm-reference.md §2.6).

Per token M2 = (log rho)^2. Mask the tokens of largest M2, greedily, until the mean M2 of the
kept tokens is below tau; the kept tokens get the importance weight rho. The paper writes
r = pi_theta / mu and drops the eps-clip; as AReaL does with its decoupled loss, decentrl
measures M2 between pi_prox and mu (the part of the gap the stale sample brings) and anchors the
ratio on pi_prox, so r = (pi_theta / pi_prox) · rho, and the configured loss's clip around
pi_prox stays: with several mini-batch steps per version it is the trust region within the
version (the mask, computed once per version, cannot see that drift).
The mask is batch-global: computed once per batch, before any mini- or micro-batching.

`tokens = "with_advantage"` restricts the mask, and the mean it bounds, to the tokens whose
probability already moved the way their advantage pushes (A · log rho > 0: a good token that
became more likely, a bad one that became less likely). The authors' released code constrains
only these ("harmful" tokens, whose further push a PPO clip would also stop); the others keep
their gradient, which pulls a drifted policy back.
"""

from __future__ import annotations

import torch

from decentrl.algo.corrections import Correction, make_correction, token_log_rho
from decentrl.config.algorithm import M2POCorrection


def m2_keep_mask(log_rho_bt: torch.Tensor, loss_mask_bt: torch.Tensor, tau: float) -> torch.Tensor:
    """True on loss tokens kept: drop the k largest M2 for the smallest k giving mean(kept) < tau."""
    m2 = log_rho_bt[loss_mask_bt] ** 2
    n = m2.numel()
    keep = loss_mask_bt.clone()
    if n == 0 or float(m2.mean()) < tau:
        return keep
    order = torch.argsort(m2, descending=True)
    sorted_m2 = m2[order].to(torch.float64)
    # mean of the kept tokens after dropping the first k (k = 0..n-1) in descending order
    dropped = torch.cat([torch.zeros(1, dtype=torch.float64), sorted_m2.cumsum(0)[:-1]])
    remaining = torch.arange(n, 0, -1, dtype=torch.float64)
    kept_mean = (sorted_m2.sum() - dropped) / remaining
    below = torch.nonzero(kept_mean < tau)
    num_drop = int(below[0]) if below.numel() else n
    flat_keep = torch.ones(n, dtype=torch.bool)
    flat_keep[order[:num_drop]] = False
    keep[loss_mask_bt] = flat_keep
    return keep


class M2PO:
    def __init__(self, config: M2POCorrection):
        self.config = config

    def __call__(
        self,
        proximal_bt: torch.Tensor,
        behaviour_bt: torch.Tensor,
        loss_mask_bt: torch.Tensor,
        advantages_bt: torch.Tensor,
    ) -> Correction:
        log_rho = token_log_rho(proximal_bt, behaviour_bt, loss_mask_bt)
        candidates = loss_mask_bt
        if self.config.tokens == "with_advantage":
            candidates = loss_mask_bt & (advantages_bt * log_rho > 0)
        keep = m2_keep_mask(log_rho, candidates, self.config.tau) | (loss_mask_bt & ~candidates)
        weights = torch.where(keep, log_rho.exp(), torch.zeros_like(log_rho))
        correction = make_correction(proximal_bt, weights, loss_mask_bt)
        correction.stats.update(second_moments(log_rho, loss_mask_bt, keep))
        return correction


def second_moments(
    log_rho_bt: torch.Tensor, loss_mask_bt: torch.Tensor, keep_bt: torch.Tensor
) -> dict[str, float]:
    """The batch's M2 over every loss token (`m2`) and over the kept ones (`m2_kept`; below tau
    with `tokens = "all"`)."""
    m2 = log_rho_bt.to(torch.float64) ** 2
    kept = loss_mask_bt & keep_bt
    return {
        "m2": float(m2[loss_mask_bt].mean()) if bool(loss_mask_bt.any()) else 0.0,
        "m2_kept": float(m2[kept].mean()) if bool(kept.any()) else 0.0,
    }
