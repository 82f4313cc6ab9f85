"""Sampling plausibility: were a worker's tokens really drawn from the policy at the leased temperature?

For a token x drawn from a discrete distribution p, the randomised probability integral transform
u = P(tokens ranked above x) + V * p(x), with V ~ U(0, 1) and tokens ranked by decreasing
probability, is exactly uniform on [0, 1], and independent across tokens (Brockwell 2007, "Universal
residuals"; Czado, Gneiting & Held 2009). That holds for any model, so the null distribution needs
no calibration: a worker that writes its completions (a pasted reference answer) instead of
sampling them moves u away from uniform even when its log-probs are honestly computed.

Neyman's smooth test (Neyman 1937; Rayner & Best 1989) measures the departure: with pi_j the
orthonormal shifted Legendre polynomials on [0, 1], T = sum_j (sum_t pi_j(u_t))^2 / n is chi^2 with
`ORDER` degrees of freedom for uniform u. Evidence is kept in blocks of a worker's verified tokens
(a new block after `block_tokens`, so a worker that turns hostile is judged on recent tokens). A
block is tested each time its token count doubles past `min_tokens` (geometric looks: few tests,
little power lost); block b may spend alpha / (b (b + 1)), split evenly over its looks, so the
chance of ever quarantining an honest worker stays below alpha however long it runs (Bonferroni
alpha spending). Pure
Python: the coordinator imports no torch or numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ORDER = 2
"""Legendre polynomials used by the test: location (pi_1) and spread (pi_2) of u."""
MAX_ORDER = 4
"""Polynomials the verifier reports (the coordinator uses the first ORDER)."""


def legendre(u: float) -> list[float]:
    """pi_1..pi_4 at u: orthonormal on U(0, 1) (zero mean, unit variance, uncorrelated)."""
    x = 2.0 * u - 1.0
    return [
        math.sqrt(3) * x,
        math.sqrt(5) * (3 * x * x - 1) / 2,
        math.sqrt(7) * (5 * x**3 - 3 * x) / 2,
        3 * (35 * x**4 - 30 * x * x + 3) / 8,
    ]


def chi2_sf(statistic: float, degrees: int) -> float:
    """Survival function of chi^2 with an even number of degrees (closed form, no scipy)."""
    assert degrees % 2 == 0 and degrees > 0, "closed form needs even degrees of freedom"
    half = statistic / 2.0
    term, total = 1.0, 1.0
    for k in range(1, degrees // 2):
        term *= half / k
        total += term
    return math.exp(-half) * total


def looks_per_block(min_tokens: int, block_tokens: int) -> int:
    return max(1, math.floor(math.log2(block_tokens / min_tokens)) + 1)


def milestone(num_tokens: int, min_tokens: int) -> int:
    """How many doublings past `min_tokens` a block holds (-1 below it); a look when it grows."""
    return -1 if num_tokens < min_tokens else math.floor(math.log2(num_tokens / min_tokens))


def look_alpha(alpha: float, block: int, looks: int) -> float:
    """Significance of one look in block `block` >= 1 of `looks` looks; the sum over all is alpha."""
    return alpha / (block * (block + 1) * looks)


@dataclass(frozen=True)
class Decision:
    p_value: float
    threshold: float
    reject: bool


def smooth_test(sums: list[float], num_tokens: int, threshold: float) -> Decision:
    """Neyman's smooth test on the Legendre sums of one evidence block."""
    statistic = sum(value * value for value in sums[:ORDER]) / max(num_tokens, 1)
    p_value = chi2_sf(statistic, ORDER)
    return Decision(p_value, threshold, p_value < threshold)
