"""KL regularisation to a frozen reference policy (docs/algorithm-reference.md §1.2).

Estimators of KL(pi_theta || pi_ref) from tokens sampled by pi_theta, with log u = log pi_ref -
log pi_theta (Schulman, http://joschu.net/blog/kl-approx.html):
  k1 = -log u            unbiased, high variance, can be negative; its expected gradient is 0
  k2 = (log u)^2 / 2     biased, low variance; gradient = that of the reverse KL (the intended one)
  k3 = u - 1 - log u     unbiased, >= 0; its gradient is the forward KL's (GRPO, verl default)
"""

from __future__ import annotations

import torch

from decentrl.algo.losses import LOG_RATIO_LIMIT


def _k1(log_u: torch.Tensor) -> torch.Tensor:
    return -log_u


def _k2(log_u: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_u**2


def _k3(log_u: torch.Tensor) -> torch.Tensor:
    return log_u.exp() - 1 - log_u


ESTIMATORS = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_per_token(
    logprobs_bt: torch.Tensor, reference_logprobs_bt: torch.Tensor, estimator: str
) -> torch.Tensor:
    """Per-token KL estimate; differentiable through `logprobs_bt` (the reference is detached)."""
    log_u = (reference_logprobs_bt.detach() - logprobs_bt).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return ESTIMATORS[estimator](log_u)
