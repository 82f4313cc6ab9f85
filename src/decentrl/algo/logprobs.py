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
    """Entropy of the temperature-scaled distribution, per position (no gradient needed)."""
    scale = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits.float() / scale, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids_bt: torch.Tensor,
    attention_mask_bt: torch.Tensor,
    temperature: float,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each token given its prefix, aligned with `input_ids_bt` (position 0 gets 0).

    Inputs are right-padded, so default position ids are correct for every row.
    """
    logits_btv = model(input_ids=input_ids_bt, attention_mask=attention_mask_bt).logits
    shifted = logprobs_from_logits(logits_btv[:, :-1], input_ids_bt[:, 1:], temperature)
    logprobs_bt = torch.nn.functional.pad(shifted, (1, 0))
    entropy_bt = None
    if with_entropy:
        with torch.no_grad():
            entropy_bt = torch.nn.functional.pad(entropy_from_logits(logits_btv[:, :-1], temperature), (1, 0))
    return logprobs_bt, entropy_bt
