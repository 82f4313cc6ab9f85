"""What every role tells its operator: a log file next to its state, periodic status lines, ETAs.

A role started by hand on a remote machine is read through its log: it must say where it is
(`v20/150`, how long is left), and keep saying it while idle, not only when something happens.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
STATUS_SECONDS = 60.0
"""How often an idle role logs its status line."""


def log_to_file(path: Path) -> Path:
    """Also write this process's log to `path` (appended: a restart continues the same file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger().addHandler(handler)
    return path


def duration(seconds: float) -> str:
    """A duration as an operator reads it: 45s, 12m05s, 3h20m."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def eta(elapsed: float, done: int, remaining: int) -> str:
    """The time left at the pace so far (`done` steps took `elapsed` seconds)."""
    if remaining <= 0:
        return "done"
    if done <= 0:
        return "unknown"
    return duration(elapsed / done * remaining)


class Every:
    """True once every `seconds` (the first call included): a throttle for status lines."""

    def __init__(self, seconds: float = STATUS_SECONDS) -> None:
        self.seconds = seconds
        self._last = -float("inf")

    def __call__(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.seconds:
            return False
        self._last = now
        return True
