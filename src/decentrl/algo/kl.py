"""KL regularisation to a frozen reference policy (docs/algorithm-reference.md §1.2).

Estimators of KL(pi_theta || pi_ref) from tokens sampled by pi_theta, with log u = log pi_ref -
log pi_theta (Schulman, http://joschu.net/blog/kl-approx.html):
  k1 = -log u            unbiased, high variance, can be negative; its expected gradient is 0
  k2 = (log u)^2 / 2     biased, low variance; gradient = that of the reverse KL (the intended one)
  k3 = u - 1 - log u     unbiased, >= 0; its gradient is the forward KL's (GRPO, verl default)

The trainer's KL term (`sampled_kl_per_token`) is DeepSeek-V3.2's unbiased KL estimate (arXiv
2512.02556, "Unbiased KL Estimate"): the estimate times pi_theta / (the policy that sampled the
token), the ratio carrying its gradient. Then the expectation over the sampled tokens is
E_{pi_theta}[k], and for k1 and k3, whose expectation is the KL itself, its gradient is exactly
that of KL(pi_theta || pi_ref); k2's expectation, and so its gradient, is biased.
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


def sampled_kl_per_token(
    logprobs_bt: torch.Tensor,
    anchor_logprobs_bt: torch.Tensor,
    weights_bt: torch.Tensor,
    reference_logprobs_bt: torch.Tensor,
    estimator: str,
) -> torch.Tensor:
    """k(pi_theta, pi_ref) * sg(w) * pi_theta / anchor per token: the correction's detached weight
    w times the trust-region ratio is pi_theta / mu (pi_prox / mu * pi_theta / pi_prox; or the
    ratio to mu itself without a correction), truncated or masked as the correction decided.
    TRL's `use_bias_correction_kl` is the same with mu = pi_old (its KL skips the vLLM weight)."""
    log_ratio = (logprobs_bt - anchor_logprobs_bt.detach()).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return kl_per_token(logprobs_bt, reference_logprobs_bt, estimator) * weights_bt.detach() * log_ratio.exp()
