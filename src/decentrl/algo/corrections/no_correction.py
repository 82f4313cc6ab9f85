"""No off-policy correction: naive PPO (AReaL's baseline, docs/algorithm-reference.md §2.2).

The ratio is pi_theta / mu, as if the stale sampling policy were the one being updated; no extra
weight. This is what a PPO implementation does when it stores the worker's log-probs as "old"
log-probs (verl's docs call the implicit pi_old = mu the common implementation mistake, §4.2):
a token whose policy has since drifted outside the clip range in the advantage's direction gets
no gradient, and its unclipped side is an unbounded importance weight.
"""

from __future__ import annotations

import torch

from decentrl.algo.corrections import Correction, make_correction
from decentrl.config.algorithm import NoCorrection


class NoneCorrection:
    def __init__(self, config: NoCorrection):
        del config  # no parameters

    def __call__(
        self,
        proximal_bt: torch.Tensor,
        behaviour_bt: torch.Tensor,
        loss_mask_bt: torch.Tensor,
        advantages_bt: torch.Tensor,
    ) -> Correction:
        del advantages_bt  # rho alone decides
        return make_correction(behaviour_bt, torch.ones_like(proximal_bt), loss_mask_bt)
