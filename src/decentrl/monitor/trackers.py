"""Experiment trackers: the trainer's step metrics and the coordinator's run statistics, logged to
TensorBoard event files and/or Weights & Biases (`[monitor] trackers`, docs/monitoring.md).

Each role writes its own stream under `monitor.log_dir` (default run_dir/trackers/<role>), so two
processes never share a file. TensorBoard files are written with tensorboard's own event writer
(no torch or TensorFlow needed, so the coordinator can log too). W&B runs offline unless
WANDB_MODE says otherwise; `wandb sync` uploads an offline run later.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from decentrl.config import MonitorConfig

log = logging.getLogger(__name__)


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoard:
    def __init__(self, directory: Path):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.writer = EventFileWriter(str(directory))

    def log(self, metrics: dict[str, float], step: int) -> None:
        # Generated protobuf modules: their classes are invisible to static checkers.
        from tensorboard.compat.proto.event_pb2 import Event  # pyright: ignore[reportAttributeAccessIssue]
        from tensorboard.compat.proto.summary_pb2 import Summary  # pyright: ignore[reportAttributeAccessIssue]

        values = [Summary.Value(tag=name, simple_value=value) for name, value in metrics.items()]
        self.writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))
        self.writer.flush()  # a crashed run keeps what it logged

    def close(self) -> None:
        self.writer.close()


class WandB:
    def __init__(self, directory: Path, project: str, name: str, config: dict):
        import wandb

        os.environ.setdefault("WANDB_MODE", "offline")  # nothing leaves the machine unless asked
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(
            project=project, name=name, dir=str(directory), config=config, reinit="create_new"
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """Every configured tracker behind one `log`. A tracker that fails is logged and dropped: a
    monitoring outage must not stop training."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def log(self, metrics: dict[str, float], step: int) -> None:
        numbers = {name: float(value) for name, value in metrics.items() if isinstance(value, int | float)}
        for tracker in list(self.trackers):
            try:
                tracker.log(numbers, step)
            except Exception:
                log.exception("tracker %s failed; dropping it", type(tracker).__name__)
                self.trackers.remove(tracker)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def open_trackers(config: MonitorConfig, run_dir: Path, role: str, run_config: dict) -> Trackers:
    """The trackers of `config` for one role (its stream is named after it)."""
    if not config.trackers:
        return Trackers([])
    root = Path(config.log_dir) if config.log_dir else run_dir / "trackers"
    directory = root / role
    directory.mkdir(parents=True, exist_ok=True)
    opened: list[Tracker] = []
    for name in config.trackers:
        if name == "tensorboard":
            opened.append(TensorBoard(directory / "tensorboard"))
        else:
            (directory / "wandb").mkdir(exist_ok=True)
            opened.append(WandB(directory / "wandb", config.project, f"{run_dir.name}-{role}", run_config))
    return Trackers(opened)


def flatten(tree: dict, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of nested stats as `a/b/c` names (the coordinator's `/v1/stats`)."""
    out: dict[str, float] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}/"))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = float(value)
    return out


class StatsLogger:
    """The coordinator's side: its run statistics (`/v1/stats`, flattened, the per-step history
    left out) to the trackers every `every_seconds`, at step = the latest policy version."""

    def __init__(self, stats: Callable[[], dict], trackers: Trackers, every_seconds: float):
        self.stats, self.trackers, self.every_seconds = stats, trackers, every_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tracker-stats", daemon=True)

    def start(self) -> StatsLogger:
        if self.trackers.trackers:
            self._thread.start()
        return self

    def log_once(self) -> None:
        snapshot = {key: value for key, value in self.stats().items() if key != "history"}
        self.trackers.log(flatten(snapshot, "coordinator/"), step=snapshot.get("latest_version") or 0)

    def _run(self) -> None:
        while not self._stop.wait(self.every_seconds):
            try:
                self.log_once()
            except Exception:  # the store was closing, a transient error: try again next time
                log.exception("logging run statistics failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
            self.log_once()  # the final numbers
        self.trackers.close()
