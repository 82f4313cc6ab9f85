"""CISPO, clipped IS-weight policy optimisation (MiniMax-M1, arXiv 2506.13585;
docs/algorithm-reference.md §1.8).

l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) · A_t · log pi_theta(y_t). The weight is clipped
and detached, so every token keeps a gradient (-clip(r) A ∇log pi), unlike PPO, whose clipped
tokens get none. Decision: the verl convention of a relative range [1-eps_low, 1+eps_high]; M1
effectively drops the lower bound, hence eps_low = 1.0 by default.
"""

from __future__ import annotations

from decentrl.algo.losses import LossInputs, LossOutput, NoShaping, log_ratio, masked_fraction
from decentrl.config.algorithm import CISPOLoss


class CISPO(NoShaping):
    def __init__(self, config: CISPOLoss):
        self.config = config

    def __call__(self, inputs: LossInputs) -> LossOutput:
        ratio = log_ratio(inputs).exp()
        weight = ratio.clamp(1 - self.config.eps_low, 1 + self.config.eps_high).detach()
        per_token = -weight * inputs.advantages_bt * inputs.logprobs_bt
        loss = (per_token * inputs.weights_bt * inputs.token_scale_bt).sum()
        was_clipped = (ratio > 1 + self.config.eps_high) | (ratio < 1 - self.config.eps_low)
        return LossOutput(loss, {"clip_fraction": masked_fraction(was_clipped, inputs.loss_mask_bt)})
