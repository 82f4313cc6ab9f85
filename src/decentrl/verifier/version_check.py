"""Was a rollout sampled with the version it claims, or with the one before? A likelihood-ratio
style test the verifier runs beside its recomputation under the claimed version.

A worker that samples with version v-1 and claims v reports log-probs that v-1 explains: each is
log p_{v-1}(token) plus its engine's numeric error n. The tolerance tests (`trust/logprob_tolerance.py`)
compare the claim with log p_v only, so a version gap per token of the order of the engine's
allowed error (a bf16 engine's mean tolerance is 0.03 nats) hides inside them. Recomputing the
same tokens under v-1 as well gives, per token t,

    s_t = |claimed - log p_v| - |claimed - log p_{v-1}|,

which is ~ +|delta_t| for a claim that v-1 explains and ~ -|delta_t| for one that v explains
(delta_t = log p_v - log p_{v-1}, known to the verifier exactly); the engine's error n enters both
terms alike and |s_t| <= |delta_t| whatever n is (triangle inequality), so bf16's rare 1-2 nat
outliers cannot swing it. Each token bets on it:

    x_t = s_t / max(|delta_t|, floor) in [-1, 1],   factor_t = 1 + BET * x_t,

floor = FLOOR * the class's mean tolerance: tokens whose versions differ by much less than the
engine's noise (near-certain tokens) carry little weight. The null is that an honest engine's
claims are on average no closer to the previous version than to their own (E[x_t] <= 0 given the
past): its numeric error does not know which way the next version moved. Under it the product of
the factors is a test supermartingale, and the coordinator runs it as a CUSUM over verdict batches
with `trust.version_alpha` spent over them (`repeats.detector_step`). Sampling itself pushes the
honest mean down: tokens drawn from p_v are those v likes better than v-1 (E[delta_t] = KL(p_v ||
p_{v-1}) >= 0). Measured on vLLM bf16 honest rollouts of the demo model and one published
perturbation (docs/security.md): E[log factor] -0.69 nats per token for honest claims, +0.30 for
wrong-version ones. A claim of v for tokens sampled with v-k (k > 1) is tested against v-1 as well:
v-1 lies between them, so it explains them better than v.

The cost is one more forward pass per verified rollout (the previous version is usually in the
verifier's cache: stale rollouts claim it).
"""

from __future__ import annotations

import torch

BET = 0.7
"""The stake per token: a token the previous version explains fully earns log(1.7) = 0.53 nats, one
the claimed version explains fully costs log(0.3) = -1.2."""
FLOOR = 0.1
"""The smallest |delta| a token's score is normalised by, as a fraction of the worker's class's mean
tolerance (bf16: 0.003 nats; float32: 0.0002)."""


def version_log_evidence(
    claimed_n: torch.Tensor,
    recomputed_n: torch.Tensor,
    previous_n: torch.Tensor,
    tolerance_mean_n: torch.Tensor,
) -> torch.Tensor:
    """log factor_t per token: claimed log-probs, the recomputation under the claimed version and
    under the one before, the mean tolerance of each token's worker (all float64, one per token)."""
    delta_n = (recomputed_n - previous_n).abs()
    score_n = (claimed_n - recomputed_n).abs() - (claimed_n - previous_n).abs()
    scale_n = torch.maximum(delta_n, FLOOR * tolerance_mean_n)
    # |score| <= delta <= scale, so x stays in [-1, 1] (clamped against rounding)
    return torch.log1p(BET * (score_n / scale_n).clamp(-1.0, 1.0))
