"""IcePop (Ling team, Ring-1T, arXiv 2510.18855; docs/algorithm-reference.md §2.4).

Token weight M(k) = k if alpha <= k <= beta else 0, with k = pi_train / pi_infer, multiplying the
clipped token objective. Motivated by MoE routing mismatch between engine and trainer; a fixed
two-sided band, [0.5, 5.0] in verl's `decoupled_token_icepop` preset. Note (Ring's May-2026
follow-up): the band masks fewer tokens as the mismatch keeps growing.
"""

from __future__ import annotations

import torch

from decentrl.algo.corrections import Correction, make_correction, token_log_rho
from decentrl.algo.corrections.mis import band
from decentrl.config.algorithm import IcePopCorrection


class IcePop:
    def __init__(self, config: IcePopCorrection):
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
        return make_correction(proximal_bt, band(rho, self.config.alpha, self.config.beta), loss_mask_bt)
