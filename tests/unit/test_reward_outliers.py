"""`worker_outlier`: groups as units, versions matched, Bonferroni over workers, hysteresis; quiet on
a recorded healthy demo, loud on the same run with one worker paid more."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from decentrl.config.rewards import RewardMonitorConfig
from decentrl.rewards.outliers import GroupReward, compare, threshold, worker_outliers

DATA = Path(__file__).parent / "data"
WINDOW_VERSIONS = 31  # the coordinator's 4000 most recent rollouts are about 31 demo versions


def test_the_statistic_by_hand():
    # Version 0: a = [1, 0.5], b = [0.5, 0]; version 1: a = [1], b = [0.5, 0.5, 0.5].
    groups = [
        GroupReward("a", 0, 1.0),
        GroupReward("a", 0, 0.5),
        GroupReward("b", 0, 0.5),
        GroupReward("b", 0, 0.0),
        GroupReward("a", 1, 1.0),
        *[GroupReward("b", 1, 0.5)] * 3,
    ]
    # Within-(worker, version) variance: (0.0625 * 2 + 0.0625 * 2 + 0 + 0) / (1 + 1 + 0 + 2) = 0.0625.
    # Weights 1 / (1/2 + 1/2) = 1 and 1 / (1 + 1/3) = 0.75; differences 0.5 and 0.5.
    # D = 0.5, its standard error sqrt(0.0625 / 1.75), so 0.5 / 0.18898 = 2.6458 sigma.
    a, b = compare(groups)
    assert (a.worker_id, a.groups) == ("a", 3)
    assert a.sigmas == pytest.approx(0.5 / math.sqrt(0.0625 / 1.75))
    assert b.sigmas == pytest.approx(-a.sigmas)
    assert a.mean == pytest.approx((1 * 0.75 + 0.75 * 1.0) / 1.75)
    # A version only one worker ran says nothing about the difference.
    assert compare([*groups, GroupReward("a", 2, 0.0)])[0].sigmas == pytest.approx(a.sigmas)


def test_threshold_is_bonferroni_over_the_workers_compared():
    config = RewardMonitorConfig(peer_alpha=1e-3)
    assert threshold(config, 1) == pytest.approx(3.0902, abs=1e-4)
    assert threshold(config, 10) == pytest.approx(3.7190, abs=1e-4)  # the 1e-4 quantile


def _recorded() -> list[GroupReward]:
    """Every group of a healthy two-worker `decentrl demo` (600 versions, group size 8)."""
    groups = []
    for row in csv.DictReader((DATA / "healthy_demo_worker_groups.csv").open()):
        version, worker = int(row["version"]), f"worker-{row['worker']}"
        groups += [GroupReward(worker, version, int(c) / 8) for c in row["correct_per_group"]]
    return groups


def _replay(groups: list[GroupReward], config: RewardMonitorConfig) -> list[tuple[int, str]]:
    """The check of every step over the last WINDOW_VERSIONS versions, with its hysteresis."""
    fired, flagged = [], set()
    for step in range(1, 601):
        window = [g for g in groups if step - WINDOW_VERSIONS < g.version <= step]
        alarms, flagged = worker_outliers(window, config, flagged)
        fired += [(step, worker) for worker, _ in alarms]
    return fired


def test_a_healthy_demo_raises_no_outlier_and_a_paid_worker_fires_once():
    groups = _recorded()
    default = RewardMonitorConfig()
    assert _replay(groups, default) == []
    # The same run, where worker-1 finds a hole at version 300 that pays 2 of its 8 rollouts more
    # (capped at 8 of 8: +0.107 a rollout on average, over its honest 0.793); flagged 28 versions later.
    paid = [
        GroupReward(g.worker_id, g.version, min(1.0, g.mean + 0.25))
        if g.worker_id == "worker-1" and g.version >= 300
        else g
        for g in groups
    ]
    fired = _replay(paid, default)
    assert len(fired) == 1 and fired[0][1] == "worker-1" and 300 < fired[0][0] <= 335, fired


def test_hysteresis_fires_again_only_after_the_worker_came_back():
    config = RewardMonitorConfig(peer_min_groups=4)
    honest = [GroupReward(w, 0, m) for w in ("a", "b") for m in (0.0, 0.5, 1.0, 0.5) * 4]
    cheat = [GroupReward("c", 0, 1.0)] * 32
    alarms, flagged = worker_outliers([*honest, *cheat], config)
    assert [w for w, _ in alarms] == ["c"] and flagged == {"c"}
    assert "mean reward 1.000 vs peers 0.500 at the same versions over 32 groups (7.8 sigma" in alarms[0][1]
    assert worker_outliers([*honest, *cheat], config, flagged) == ([], {"c"})  # still out: silent
    back = [GroupReward("c", 0, m) for m in (0.0, 0.5, 1.0, 0.5)]
    assert worker_outliers([*honest, *back], config, flagged) == ([], set())  # re-armed
    assert [w for w, _ in worker_outliers([*honest, *cheat], config, set())[0]] == ["c"]
    # Too few groups: not judged at all.
    assert worker_outliers([*honest, *cheat[:3]], config) == ([], set())
