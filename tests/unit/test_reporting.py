"""Durations and ETAs as the roles' status lines print them (`monitor/reporting.py`)."""

from __future__ import annotations

from decentrl.monitor.reporting import duration, eta


def test_durations_read_as_seconds_minutes_or_hours() -> None:
    assert [duration(s) for s in (0, 44.6, 60, 725, 3600, 12_000)] == [
        "0s",
        "45s",
        "1m00s",
        "12m05s",
        "1h00m",
        "3h20m",
    ]


def test_the_eta_is_the_pace_so_far_times_the_steps_left() -> None:
    assert eta(elapsed=100.0, done=20, remaining=130) == "10m50s"
    assert eta(elapsed=100.0, done=0, remaining=130) == "unknown"
    assert eta(elapsed=100.0, done=150, remaining=0) == "done"
