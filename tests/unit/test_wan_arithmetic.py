"""`decentrl bench wan`'s arithmetic: the churn schedule, the reach of a version over the online
fleet, and the comparison of the modes, against hand-computed values."""

from __future__ import annotations

import pytest

from benchmarks.wan.fleet import churn_schedule
from benchmarks.wan.main import aggregate, speedups
from benchmarks.wan.measure import reach_seconds, summarise_reach


def test_the_churn_schedule_is_seeded_and_kills_the_asked_share() -> None:
    schedule = churn_schedule(seed=3, num_workers=10, share_per_minute=0.2, duration_s=3600, downtime_s=10)
    assert schedule == churn_schedule(
        seed=3, num_workers=10, share_per_minute=0.2, duration_s=3600, downtime_s=10
    )
    assert schedule != churn_schedule(
        seed=4, num_workers=10, share_per_minute=0.2, duration_s=3600, downtime_s=10
    )
    # 20 % of 10 workers a minute for an hour: 120 kills expected (Poisson: within 3 sigma, ~33)
    assert 87 <= len(schedule) <= 153
    times = [kill.at_s for kill in schedule]
    assert times == sorted(times) and times[-1] < 3600
    # a worker is never killed again while it is down
    for worker in range(10):
        own = [kill.at_s for kill in schedule if kill.worker == worker]
        assert all(later - earlier >= 10 for earlier, later in zip(own, own[1:], strict=False))
    assert churn_schedule(seed=3, num_workers=10, share_per_minute=0.0, duration_s=3600, downtime_s=10) == []


def test_a_version_reaches_ninety_percent_of_the_workers_online_at_its_publication() -> None:
    published = {1: 100.0, 2: 110.0}
    lives = {f"w{i}": [[0.0, None]] for i in range(10)}
    lives["w9"] = [[0.0, 105.0]]  # killed before v2: not counted for it
    loaded = {f"w{i}": [(100.0 + i, 1), (111.0 + i, 2)] for i in range(9)}  # w9 never loaded anything
    # v1: 10 online, 9 needed; the 9th to load it is w8 at 108 -> 8 s
    # v2: 9 online, 9 needed (ceil 8.1); the 9th is w8 at 119 -> 9 s
    assert reach_seconds(published, loaded, lives) == [8.0, 9.0]
    # a later version counts as reaching an earlier one (w8 skips v1); v2's 9th is now w7 at 118
    loaded["w8"] = [(112.0, 2)]
    assert reach_seconds(published, loaded, lives) == [12.0, 8.0]
    # fewer than 90 % ever reach it
    del loaded["w8"]
    assert reach_seconds(published, loaded, lives) == [None, None]
    summary = summarise_reach([2.0, None, 4.0, 3.0])
    assert summary == {"versions": 4, "reached_share": 0.75, "median_s": 3.0, "p90_s": 4.0}


def run(mode: str, rtt: float, seed: int, seconds: float | None) -> dict:
    return {
        "mode": mode,
        "rtt_ms": rtt,
        "seed": seed,
        "time_to_threshold_s": seconds,
        "trained_rollouts_per_second": 100.0,
        "trainer_idle_share": 0.5,
        "staleness_mean": 0.0 if mode == "barrier" else 3.0,
        "bytes_per_version": 1000,
        "reach_90": {"median_s": 1.0},
    }


def test_modes_are_compared_per_rtt_over_their_seeds() -> None:
    results = [
        run("decentrl", 200.0, 0, 30.0),
        run("decentrl", 200.0, 1, 50.0),
        run("barrier", 200.0, 0, 100.0),
        run("barrier", 200.0, 1, 140.0),
        run("decentrl", 500.0, 0, 60.0),
        run("barrier", 500.0, 0, None),  # never reached the threshold
        run("nolatency", 0.0, 0, 20.0),
    ]
    rows = aggregate(results)
    assert [(r["mode"], r["rtt_ms"]) for r in rows] == [
        ("nolatency", 0.0),
        ("decentrl", 200.0),
        ("barrier", 200.0),
        ("decentrl", 500.0),
        ("barrier", 500.0),
    ]
    assert rows[1]["time_to_threshold_s_mean"] == pytest.approx(40.0)
    assert rows[2]["time_to_threshold_s"] == [100.0, 140.0]
    assert rows[4]["time_to_threshold_s_mean"] is None
    assert speedups(rows) == {"200": pytest.approx(40.0 / 120.0, abs=1e-3), "500": None}
