"""Truncated importance sampling (Yao, Liu et al., "Your efficient RL framework secretly brings
you off-policy RL training"; verl `rollout_is=token|sequence`; docs/algorithm-reference.md §2.3-2.4).

Weight min(rho, C), a constant per token (token level, biased: it drops the later-token traces
of V-trace, §2.1) or min(prod_t rho_t, C) broadcast over the sequence (unbiased before truncation,
higher variance). The clip is centred on pi_prox.
"""

from __future__ import annotations

import torch

from decentrl.algo.corrections import Correction, make_correction, sequence_log_rho, token_log_rho
from decentrl.config.algorithm import TISCorrection


class TIS:
    def __init__(self, config: TISCorrection):
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
        return make_correction(proximal_bt, rho.clamp(max=self.config.cap), loss_mask_bt)
