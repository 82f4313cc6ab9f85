"""Roles started by a launcher (`decentrl demo`, the benchmarks) end when it is gone.

A launcher stops its roles with SIGTERM when it exits, is interrupted or fails. Only when the
launcher itself is killed (SIGKILL, OOM killer) does nobody do that, and the roles would run on as
orphans holding ports and CPU. So the launcher names itself in `DECENTRL_PARENT_PID`, and a role
that sees its parent change sends itself SIGTERM: the same graceful stop (finish the step,
checkpoint, publish, exit 0) as any other. Portable: polls `os.getppid()`, no prctl.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger(__name__)

ENV = "DECENTRL_PARENT_PID"
POLL_SECONDS = 1.0


def watch_parent() -> threading.Thread | None:
    """Start the watch when this process was launched with `DECENTRL_PARENT_PID`."""
    expected = os.environ.get(ENV)
    if not expected:
        return None
    parent = int(expected)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank watches its torchrun agent, itself watching us
        parent = os.getppid()
    thread = threading.Thread(target=_watch, args=(parent,), name="parent-watch", daemon=True)
    thread.start()
    return thread


def _watch(parent: int) -> None:
    stop = threading.Event()
    while not stop.wait(POLL_SECONDS):
        if os.getppid() != parent:
            log.warning("the launcher (pid %d) is gone; stopping as on SIGTERM", parent)
            os.kill(os.getpid(), signal.SIGTERM)
            return
