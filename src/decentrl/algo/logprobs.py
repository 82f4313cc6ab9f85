"""Per-token log-probabilities: the single definition shared by engines, trainer and verifier.

Log-probs are taken under the temperature-scaled distribution that sampled the token
(../shared/reference/algorithms.md §4.1): trainer logits are divided by the same temperature
as the worker's. Computed in fp32 with log_softmax, then gathered (§4.4).
"""

from __future__ import annotations

import torch


def logprobs_from_logits(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token_ids) from `logits` [..., V]; temperature 0 (greedy) uses the raw distribution."""
    scale = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits.float() / scale, dim=-1)
    return logp.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of the temperature-scaled distribution, per position."""
    scale = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits.float() / scale, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids_bt: torch.Tensor,
    attention_mask_bt: torch.Tensor,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each token given its prefix, aligned with `input_ids_bt` (position 0 gets 0).

    Inputs are right-padded, so default position ids are correct for every row. The entropy of
    the distribution at each position (aligned the same way) is differentiable only when
    `entropy_grad` (an entropy bonus needs it; a diagnostic does not).
    """
    logits_btv = model(input_ids=input_ids_bt, attention_mask=attention_mask_bt).logits
    shifted = logprobs_from_logits(logits_btv[:, :-1], input_ids_bt[:, 1:], temperature)
    logprobs_bt = torch.nn.functional.pad(shifted, (1, 0))
    entropy_bt = None
    if with_entropy or entropy_grad:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits_btv[:, :-1], temperature)
        entropy_bt = torch.nn.functional.pad(entropy, (1, 0))
    return logprobs_bt, entropy_bt
