"""Loss aggregation: the per-token factor that turns a sum of token losses into the batch loss.

Every denominator is a count over the *global* batch (§0 and §4.5 of
docs/algorithm-reference.md), passed in by the trainer, so splitting the batch into
micro-batches and adding their losses gives the same loss and gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchCounts:
    """Counts over the whole batch (not a micro-batch)."""

    num_loss_tokens: int
    num_sequences: int
    max_new_tokens: int


def _token_mean(mask_bt: torch.Tensor, counts: BatchCounts) -> torch.Tensor:
    """1 / N_tokens: DAPO's token-level loss, prime-rl, verl token-mean."""
    return mask_bt / max(1, counts.num_loss_tokens)


def _sequence_mean(mask_bt: torch.Tensor, counts: BatchCounts) -> torch.Tensor:
    """1 / (|y_i| N_sequences): each response averaged over its own tokens (GRPO paper, GSPO)."""
    lengths_b1 = mask_bt.sum(-1, keepdim=True).clamp(min=1)
    return mask_bt / (lengths_b1 * max(1, counts.num_sequences))


def _constant(mask_bt: torch.Tensor, counts: BatchCounts) -> torch.Tensor:
    """1 / (N_sequences max_new_tokens): Dr. GRPO's length-free normaliser."""
    return mask_bt / (max(1, counts.num_sequences) * counts.max_new_tokens)


AGGREGATIONS = {"token_mean": _token_mean, "sequence_mean": _sequence_mean, "constant": _constant}


def token_scale(
    mode: str, loss_mask_bt: torch.Tensor, counts: BatchCounts, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Per-token factor of `mode` (AlgorithmConfig.aggregation), zero off the loss mask."""
    return AGGREGATIONS[mode](loss_mask_bt.to(dtype), counts)
