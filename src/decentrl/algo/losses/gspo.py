"""GSPO, group sequence policy optimisation (Zheng et al., Qwen, arXiv 2507.18071;
docs/algorithm-reference.md §1.7).

One ratio per sequence, the geometric mean of its token ratios: s_i = exp(mean_t log r_{i,t}),
clipped as a whole (paper range 3e-4 / 4e-4). Every loss token of a response carries the same
-min(s_i A_i, clip(s_i) A_i); with `aggregation = "sequence_mean"` each response counts once, as
in the paper (verl forces that mode for GSPO; decentrl leaves it to the config).

A token that the off-policy correction rejects (weight 0: MIS, IcePop, M2PO, a decoupled mask)
is left out of its sequence's ratio too: inside s_i it would still get a gradient through the
other tokens' terms. The ratio is the geometric mean over the kept tokens.
"""

from __future__ import annotations

import torch

from decentrl.algo.losses import LossInputs, LossOutput, NoShaping, log_ratio
from decentrl.config.algorithm import GSPOLoss

SEQUENCE_LOG_RATIO_LIMIT = 10.0  # verl clamps GSPO's sequence log-ratio at 10


class GSPO(NoShaping):
    def __init__(self, config: GSPOLoss):
        self.config = config

    def __call__(self, inputs: LossInputs) -> LossOutput:
        mask = inputs.loss_mask_bt.to(inputs.logprobs_bt.dtype)
        lengths_b = mask.sum(-1).clamp(min=1)
        kept = mask * (inputs.weights_bt > 0)
        mean_log_ratio_b = (log_ratio(inputs) * kept).sum(-1) / kept.sum(-1).clamp(min=1)
        ratio_b = mean_log_ratio_b.clamp(max=SEQUENCE_LOG_RATIO_LIMIT).exp()
        # A response's advantage is the same on all its tokens; read it off the first loss token.
        advantages_b = (inputs.advantages_bt * mask).sum(-1) / lengths_b
        unclipped = ratio_b * advantages_b
        clipped = ratio_b.clamp(1 - self.config.eps_low, 1 + self.config.eps_high) * advantages_b
        per_sequence = -torch.minimum(unclipped, clipped)
        per_token = per_sequence.unsqueeze(-1) * mask
        loss = (per_token * inputs.weights_bt * inputs.token_scale_bt).sum()
        has_tokens = mask.sum(-1) > 0
        clip_fraction = float(((clipped < unclipped) & has_tokens).sum() / has_tokens.sum().clamp(min=1))
        return LossOutput(loss, {"clip_fraction": clip_fraction})
