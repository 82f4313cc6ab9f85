"""Trackers write what they are given: TensorBoard event files read back with tensorboard's own
reader, and an offline W&B run directory; a tracker that breaks is dropped, not fatal."""

from __future__ import annotations

import pytest

from decentrl.config import MonitorConfig
from decentrl.monitor.trackers import StatsLogger, Trackers, flatten, open_trackers


def read_scalars(directory) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {
        tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_tensorboard_event_files_read_back(tmp_path):
    trackers = open_trackers(MonitorConfig(trackers=["tensorboard"]), tmp_path, "trainer", {})
    trackers.log({"trainer/reward_mean": 0.25, "trainer/loss": -1.5, "label": "not a number"}, step=1)
    trackers.log({"trainer/reward_mean": 0.75}, step=2)
    trackers.close()
    scalars = read_scalars(tmp_path / "trackers" / "trainer" / "tensorboard")
    assert scalars["trainer/reward_mean"] == [(1, 0.25), (2, 0.75)]
    assert scalars["trainer/loss"] == [(1, -1.5)]
    assert "label" not in scalars


def test_nothing_is_written_without_trackers(tmp_path):
    open_trackers(MonitorConfig(), tmp_path, "trainer", {}).close()
    assert not (tmp_path / "trackers").exists()


def test_wandb_runs_offline_into_the_run_directory(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")
    trackers = open_trackers(
        MonitorConfig(trackers=["wandb"], log_dir=str(tmp_path / "logs")),
        tmp_path,
        "coordinator",
        {"seed": 3},
    )
    trackers.log({"coordinator/rollouts_accepted": 10.0}, step=5)
    trackers.close()
    runs = list((tmp_path / "logs" / "coordinator" / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), runs


def test_a_failing_tracker_is_dropped():
    class Broken:
        def log(self, metrics, step):
            raise OSError("disk full")

        def close(self):
            pass

    trackers = Trackers([Broken()])
    trackers.log({"x": 1.0}, step=0)
    assert trackers.trackers == []


def test_flatten_keeps_numeric_leaves():
    stats = {
        "latest_version": 3,
        "recent": {"accuracy": 0.5, "count": 8},
        "live": True,
        "name": "x",
        "none": None,
    }
    assert flatten(stats) == {"latest_version": 3.0, "recent/accuracy": 0.5, "recent/count": 8.0}


def test_stats_logger_logs_the_coordinator_statistics_at_the_latest_version(tmp_path):
    trackers = open_trackers(MonitorConfig(trackers=["tensorboard"]), tmp_path, "coordinator", {})
    snapshot = {
        "latest_version": 7,
        "rollouts_accepted": 96,
        "staleness": {"mean": 1.5},
        "history": [{"x": 1}],
    }
    logger = StatsLogger(lambda: snapshot, trackers, every_seconds=3600).start()
    logger.stop()  # logs the final numbers once
    scalars = read_scalars(tmp_path / "trackers" / "coordinator" / "tensorboard")
    assert scalars["coordinator/rollouts_accepted"] == [(7, 96.0)]
    assert scalars["coordinator/staleness/mean"] == [(7, 1.5)]
    assert not any(tag.startswith("coordinator/history") for tag in scalars)
