"""`worker_outlier`: a worker whose rollouts score far above its peers' at the same policy versions.

Every worker samples the same task stream with the same published weights, so an honest worker's
rewards differ from its peers' only by chance; one that scores clearly higher may have found a
grader hole the others have not, or be submitting answers it did not sample. The test has to
respect how the numbers are made, or it fires on healthy runs (a per-rollout z-test fired 24 and
34 times in two healthy 600-version demos with two identical workers):

- **The unit is the group**, not the rollout: a group's rollouts answer one problem on one worker,
  so they rise and fall together with its difficulty; counted as independent, 8 rollouts look
  like 8 observations and the standard error shrinks by up to sqrt(8).
- **Versions are matched**: the reward climbs as the policy learns, so a worker is compared with
  its peers version by version (a stratified difference of means), never across versions.
- **Correction for the number of workers**: each check compares every worker with the rest, so the
  one-sided threshold is the normal quantile at `peer_alpha / workers` (Bonferroni).
- **Hysteresis**: a worker fires once when it crosses the threshold, and again only after it has
  come back below `peer_rearm_sigmas`; a lasting outlier is one alarm, not one per window.
- A worker is judged only with at least `peer_min_groups` groups at versions its peers also ran.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from statistics import NormalDist

from decentrl.config.rewards import RewardMonitorConfig

VARIANCE_FLOOR = 0.01
"""Lower bound of the within-version variance of group means: rewards are bounded, and an
all-equal window (every group at 1.0) must not make every tiny difference infinitely significant."""


@dataclass(frozen=True)
class GroupReward:
    """One group's scored rollouts, the unit the test counts."""

    worker_id: str
    version: int
    """The policy version its rollouts were sampled with (the oldest, when they differ)."""
    mean: float
    """Mean reward of its scored rollouts."""


@dataclass(frozen=True)
class Comparison:
    worker_id: str
    groups: int
    """The worker's groups at versions its peers also ran."""
    mean: float
    peer_mean: float
    sigmas: float
    """Stratified difference of means over its standard error."""


def _pooled_variance(cells: dict[tuple[str, int], list[float]]) -> float:
    """Within-(worker, version) variance of group means, pooled over every cell."""
    squares = sum(sum((x - sum(xs) / len(xs)) ** 2 for x in xs) for xs in cells.values())
    freedom = sum(len(xs) - 1 for xs in cells.values())
    return max(squares / freedom if freedom > 0 else 0.0, VARIANCE_FLOOR)


def compare(groups: Sequence[GroupReward]) -> list[Comparison]:
    """Every worker against all the others, version by version."""
    cells: dict[tuple[str, int], list[float]] = defaultdict(list)
    for group in groups:
        cells[(group.worker_id, group.version)].append(group.mean)
    variance = _pooled_variance(cells)
    by_version: dict[int, dict[str, list[float]]] = defaultdict(dict)
    for (worker_id, version), means in cells.items():
        by_version[version][worker_id] = means
    comparisons = []
    for worker_id in sorted({g.worker_id for g in groups}):
        weight_sum = difference = own = peer = 0.0
        count = 0
        for workers in by_version.values():
            mine = workers.get(worker_id)
            theirs = [x for other, xs in workers.items() if other != worker_id for x in xs]
            if not mine or not theirs:
                continue
            # Weight of a version: the inverse variance of its difference of means (up to s^2).
            weight = 1.0 / (1.0 / len(mine) + 1.0 / len(theirs))
            mine_mean, theirs_mean = sum(mine) / len(mine), sum(theirs) / len(theirs)
            weight_sum += weight
            difference += weight * (mine_mean - theirs_mean)
            own += weight * mine_mean
            peer += weight * theirs_mean
            count += len(mine)
        if count == 0:
            continue
        sigmas = (difference / weight_sum) / math.sqrt(variance / weight_sum)
        comparisons.append(Comparison(worker_id, count, own / weight_sum, peer / weight_sum, sigmas))
    return comparisons


def threshold(config: RewardMonitorConfig, workers: int) -> float:
    """One-sided normal quantile at `peer_alpha` split over the workers compared."""
    return NormalDist().inv_cdf(1.0 - config.peer_alpha / max(workers, 1))


def worker_outliers(
    groups: Sequence[GroupReward], config: RewardMonitorConfig, flagged: Iterable[str] = ()
) -> tuple[list[tuple[str, str]], set[str]]:
    """(worker id, detail) of each worker that crosses the threshold and is not already flagged,
    and the workers flagged after this check (the state the next check is given)."""
    judged = [c for c in compare(groups) if c.groups >= config.peer_min_groups]
    limit = threshold(config, len(judged))
    still = set(flagged)
    alarms = []
    for c in judged:
        if c.worker_id in still:
            if c.sigmas < config.peer_rearm_sigmas:
                still.discard(c.worker_id)
            continue
        if c.sigmas > limit:
            still.add(c.worker_id)
            alarms.append(
                (
                    c.worker_id,
                    f"mean reward {c.mean:.3f} vs peers {c.peer_mean:.3f} at the same versions over "
                    f"{c.groups} groups ({c.sigmas:.1f} sigma; the alarm is above {limit:.1f})",
                )
            )
    present = {g.worker_id for g in groups}
    return alarms, {w for w in still if w in present}
