"""Scores of an evaluation and their confidence intervals.

pass@k is the unbiased estimator of Chen et al. 2021 (arXiv:2107.03374, eq. 1): with n samples of
a problem of which c are correct, the chance that k samples drawn without replacement contain a
correct one is 1 - C(n-c, k) / C(n, k). avg@k is the mean reward of the k samples. A benchmark
score is the mean over problems; its interval treats problems as the random draw (the central
limit theorem over problems, as in Miller 2024, "Adding Error Bars to Evals", arXiv:2411.00640).
For 0/1 scores of single attempts (greedy pass@1) the Wilson interval is used instead: it stays
inside [0, 1] and is not degenerate at 0 % or 100 %.
"""

from __future__ import annotations

import math
from statistics import NormalDist

from pydantic import BaseModel


class Score(BaseModel):
    """A mean over problems with a two-sided confidence interval."""

    value: float
    low: float
    high: float


def z_value(confidence: float) -> float:
    """The normal quantile of a two-sided interval: 1.96 for 0.95."""
    assert 0.0 < confidence < 1.0, confidence
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Probability that k of the n samples (drawn without replacement) hold a correct one."""
    assert 0 <= num_correct <= num_samples and 1 <= k <= num_samples, (num_samples, num_correct, k)
    if num_samples - num_correct < k:
        return 1.0
    # 1 - prod_{i = n-c+1}^{n} (1 - k / i): the ratio of binomials without overflowing factorials.
    miss = 1.0
    for i in range(num_samples - num_correct + 1, num_samples + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def wilson(successes: float, total: int, confidence: float) -> Score:
    """Wilson score interval of a proportion (Wilson 1927)."""
    assert total > 0
    z = z_value(confidence)
    p = successes / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return Score(value=p, low=max(0.0, centre - half), high=min(1.0, centre + half))


def mean_interval(values: list[float], confidence: float) -> Score:
    """Mean with a normal interval from the standard error over problems (clipped to [0, 1],
    where every score of this module lives)."""
    assert values
    n = len(values)
    mean = sum(values) / n
    variance = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    half = z_value(confidence) * math.sqrt(variance / n)
    return Score(value=mean, low=max(0.0, mean - half), high=min(1.0, mean + half))
