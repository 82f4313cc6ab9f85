"""What a recomputation says about a rollout's claimed tokens: log-prob errors with the mean test's
evidence, and the sampling-plausibility sums. The verifier (`verifier/recompute.py`, the whole
model) and the stage trainers (`trainer/stage_verification.py`, the last stage on its committed
inputs) measure with these, so a rollout is judged the same whoever recomputed it. torch (the
coordinator, which only judges the numbers, never imports this module).
"""

from __future__ import annotations

import torch

from decentrl.trust.logprob_tolerance import BET, CLIP
from decentrl.trust.plausibility import MAX_ORDER, legendre


def token_errors(
    recomputed_n: torch.Tensor, claimed_n: torch.Tensor, mean_n: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """|claimed - recomputed| per token (float64), and each token's log-evidence for the mean
    test against its worker's tolerance `mean_n` (trust/logprob_tolerance.py)."""
    error_n = (recomputed_n.double() - claimed_n.double()).abs()
    evidence_n = torch.log1p(BET / mean_n * (error_n.clamp(max=CLIP) - mean_n))
    return error_n, evidence_n


def pit_sums(
    logits_nv: torch.Tensor,
    tokens_n: torch.Tensor,
    temperature_n: torch.Tensor,
    owner_n: torch.Tensor,
    num_jobs: int,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per job: Legendre sums of the randomised PIT u = P(more probable tokens) + V * p(token) of
    its sampled (temperature > 0) tokens, and how many there were. V comes from `seed`, the jobs'
    secret seeds, so a worker cannot know it."""
    sampled = temperature_n > 0
    sums_jk = torch.zeros((num_jobs, MAX_ORDER), dtype=torch.float64)
    counts_j = torch.zeros(num_jobs, dtype=torch.long)
    if not bool(sampled.any()):
        return sums_jk, counts_j
    logits_nv, tokens_n, owner_n = logits_nv[sampled], tokens_n[sampled], owner_n[sampled]
    probs_nv = torch.softmax(logits_nv.double() / temperature_n[sampled][:, None], dim=-1)
    chosen_n = probs_nv.gather(-1, tokens_n[:, None]).squeeze(-1)
    above_n = (probs_nv * (probs_nv > chosen_n[:, None])).sum(-1)
    jitter_n = torch.rand(len(tokens_n), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    u_n = (above_n + jitter_n * chosen_n).clamp(0.0, 1.0)
    # legendre() is plain arithmetic, so it evaluates element-wise on a tensor as on a float
    sums_jk.index_add_(0, owner_n, torch.stack(legendre(u_n), dim=-1))  # pyright: ignore[reportArgumentType]
    counts_j.index_add_(0, owner_n, torch.ones_like(owner_n))
    return sums_jk, counts_j
