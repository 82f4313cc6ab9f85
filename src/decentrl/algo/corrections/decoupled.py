"""Decoupled PPO (Hilton et al., arXiv 2110.00641; AReaL, arXiv 2505.24298;
docs/algorithm-reference.md §2.2).

J = E_{y~mu}[ sum_t (pi_prox/mu)(y_t) · min(u_t A, clip(u_t, 1±eps) A) ], u_t = pi_theta/pi_prox.
The clip is centred on the recent proximal policy, not on the stale mu; the behaviour weight
rho = pi_prox/mu corrects for sampling from mu. Tokens whose rho exceeds `cap` are masked (AReaL's
rejection upper bound, action "mask") or their weight clamped to `cap` (action "truncate").
"""

from __future__ import annotations

import torch

from decentrl.algo.corrections import Correction, make_correction, token_log_rho
from decentrl.config.algorithm import DecoupledCorrection


class Decoupled:
    def __init__(self, config: DecoupledCorrection):
        self.config = config

    def __call__(
        self,
        proximal_bt: torch.Tensor,
        behaviour_bt: torch.Tensor,
        loss_mask_bt: torch.Tensor,
        advantages_bt: torch.Tensor,
    ) -> Correction:
        del advantages_bt  # rho alone decides
        rho = token_log_rho(proximal_bt, behaviour_bt, loss_mask_bt).exp()
        if self.config.action == "mask":
            weights = torch.where(rho > self.config.cap, torch.zeros_like(rho), rho)
        else:
            weights = rho.clamp(max=self.config.cap)
        return make_correction(proximal_bt, weights, loss_mask_bt)
