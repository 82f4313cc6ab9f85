"""The coordinator's own voice in its log: what the run waits on, and a periodic status line.

A thread refreshes `RoleWatch.waiting` every `CHECK_SECONDS` (so 204 answers carry it without
touching the store), logs a warning when the set of waited-on roles changes and again every
`REPEAT_SECONDS` while it lasts, and logs one status line every `STATUS_SECONDS`.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

from decentrl.coordinator import metrics
from decentrl.coordinator.context import Context
from decentrl.coordinator.db.store import get_meta, latest_version
from decentrl.coordinator.run_record import RUN_COMPLETE_META, TRAINER_RUN_META
from decentrl.monitor.reporting import duration

log = logging.getLogger("decentrl.coordinator")

CHECK_SECONDS = 5.0
REPEAT_SECONDS = 60.0
STATUS_SECONDS = 30.0
STALL_SECONDS = 300.0
"""No new rollout and no new version for this long, with every role there: the run is stalled."""


def status_line(context: Context) -> str:
    """version N, accepted, held, workers active/registered, connected trusted roles."""
    with context.store.transaction() as db:
        version = latest_version(db)
        reported = json.loads(get_meta(db, TRAINER_RUN_META) or "null")
        accepted = db.execute("SELECT COUNT(*) FROM rollouts").fetchone()[0]
        held = db.execute("SELECT COUNT(DISTINCT task_id) FROM holds").fetchone()[0]
        workers = db.execute("SELECT COUNT(*) FROM workers").fetchone()[0]
        active = db.execute(
            "SELECT COUNT(*) FROM workers WHERE last_seen >= ?", (context.clock() - 60.0,)
        ).fetchone()[0]
    connected = context.roles.connected()
    roles = ", ".join(f"{role} {'yes' if up else 'no'}" for role, up in connected.items())
    shown = "none" if version is None else str(version)
    shown += f"/{reported['num_steps']}" if reported else ""
    return (
        f"status: version {shown}, rollouts accepted {accepted}, groups held {held}, "
        f"workers {active} active / {workers} registered; connected: {roles}"
    )


def _first_last(history: list[dict], name: str) -> str:
    values = [(step["policy_version"], step["metrics"][name]) for step in history if name in step["metrics"]]
    if not values:
        return "not measured"
    (first_version, first), (last_version, last) = values[0], values[-1]
    return f"{first:.3f} (v{first_version}) -> {last:.3f} (v{last_version})"


def summary_lines(stats: dict, run_dir: Path) -> list[str]:
    """The end of a run as its operator wants it: what it made, what it refused, what it learned."""
    history = stats["history"]
    rejected = stats["rollouts_rejected"]
    return [
        f"run complete: version {stats['latest_version']} published after {duration(stats['uptime_seconds'])}",
        f"rollouts accepted {stats['rollouts_accepted']} from {stats['workers']} workers, "
        f"rejected {rejected['total']} {rejected['by_reason'] or ''}".rstrip(),
        f"held-out accuracy (first -> last eval) {_first_last(history, 'eval_accuracy')}, "
        f"train reward {_first_last(history, 'reward_mean')}",
        "workers exit on their next lease request; stop the coordinator with Ctrl-C (the run "
        f"directory keeps everything: `decentrl export {run_dir} --out DIR`)",
    ]


class StatusReporter:
    def __init__(self, context: Context) -> None:
        self.context = context
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="coordinator-status", daemon=True)
        self._said: tuple[str, ...] = ()
        self._said_at = 0.0
        self._status_at = 0.0
        self._progress: tuple = ()
        self._progress_at = context.clock()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def check(self) -> None:
        now = self.context.clock()
        with self.context.store.transaction() as db:
            waiting = self.context.roles.refresh(db)
            complete = json.loads(get_meta(db, RUN_COMPLETE_META) or "null")
            progress = (latest_version(db), db.execute("SELECT COUNT(*) FROM rollouts").fetchone()[0])
        self.context.roles.complete = complete
        if progress != self._progress or waiting or complete:
            self._progress, self._progress_at = progress, now
        stalled = now - self._progress_at >= STALL_SECONDS
        if stalled and self.context.roles.stalled_since is None:
            log.warning(
                "stalled: no rollout accepted and no version published for %s, though no role is missing",
                duration(now - self._progress_at),
            )
        self.context.roles.stalled_since = self._progress_at if stalled else None
        roles = tuple(entry["role"] for entry in waiting)
        if roles != self._said:
            self._status_at = 0.0  # with the status line that shows who is connected
        if roles != self._said or (roles and now - self._said_at >= REPEAT_SECONDS):
            for entry in waiting:
                log.warning("%s", entry["message"])
            if self._said and not roles:
                log.info("no longer waiting for %s", " or ".join(self._said))
            self._said, self._said_at = roles, now
        if now - self._status_at >= STATUS_SECONDS:
            log.info("%s", status_line(self.context))
            self._status_at = now

    def finish(self) -> None:
        """The run is complete: log its summary, and wake the workers' long polls (they exit)."""
        with self.context.store.transaction() as db:
            self.context.roles.complete = json.loads(get_meta(db, RUN_COMPLETE_META) or "null")
        for line in summary_lines(metrics.stats(self.context), self.context.run_dir):
            log.info("%s", line)
        self.context.room.notify()

    def _run(self) -> None:
        while not self._stop.wait(CHECK_SECONDS):
            try:
                self.check()
            except Exception:  # the store was closing, a transient error: try again next time
                log.exception("status check failed")
