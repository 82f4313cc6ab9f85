"""Masked importance sampling (Liu, Li et al., "When speed kills stability"; verl seq-MIS;
docs/algorithm-reference.md §2.4).

Keep the weight rho (token) or prod_t rho_t (sequence), but reject, weight 0, every token or
whole sequence whose rho lies outside [lower, upper]: instead of trusting a truncated estimate
of a sample that is too far off-policy, drop it.
"""

from __future__ import annotations

import torch

from decentrl.algo.corrections import Correction, make_correction, sequence_log_rho, token_log_rho
from decentrl.config.algorithm import MISCorrection


def band(rho_bt: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    """rho inside [lower, upper], 0 outside."""
    inside = (rho_bt >= lower) & (rho_bt <= upper)
    return torch.where(inside, rho_bt, torch.zeros_like(rho_bt))


class MIS:
    def __init__(self, config: MISCorrection):
        self.config = config
        self.log_rho = token_log_rho if config.level == "token" else sequence_log_rho

    def __call__(
        self,
        proximal_bt: torch.Tensor,
        behaviour_bt: torch.Tensor,
        loss_mask_bt: torch.Tensor,
        advantages_bt: torch.Tensor,
    ) -> Correction:
        del advantages_bt  # rho alone decides
        rho = self.log_rho(proximal_bt, behaviour_bt, loss_mask_bt).exp()
        return make_correction(proximal_bt, band(rho, self.config.lower, self.config.upper), loss_mask_bt)
