"""The coordinator's own voice in its log: what the run waits on, and a periodic status line.

A thread refreshes `RoleWatch.waiting` every `CHECK_SECONDS` (so 204 answers carry it without
touching the store), logs a warning when the set of waited-on roles changes and again every
`REPEAT_SECONDS` while it lasts, and logs one status line every `STATUS_SECONDS`.
"""

from __future__ import annotations

import logging
import threading

from decentrl.coordinator.context import Context
from decentrl.coordinator.db.store import latest_version

log = logging.getLogger("decentrl.coordinator")

CHECK_SECONDS = 5.0
REPEAT_SECONDS = 60.0
STATUS_SECONDS = 30.0


def status_line(context: Context) -> str:
    """version N, accepted, held, workers active/registered, connected trusted roles."""
    with context.store.transaction() as db:
        version = latest_version(db)
        accepted = db.execute("SELECT COUNT(*) FROM rollouts").fetchone()[0]
        held = db.execute("SELECT COUNT(DISTINCT task_id) FROM holds").fetchone()[0]
        workers = db.execute("SELECT COUNT(*) FROM workers").fetchone()[0]
        active = db.execute(
            "SELECT COUNT(*) FROM workers WHERE last_seen >= ?", (context.clock() - 60.0,)
        ).fetchone()[0]
    connected = context.roles.connected()
    roles = ", ".join(f"{role} {'yes' if up else 'no'}" for role, up in connected.items())
    shown = "none" if version is None else str(version)
    return (
        f"status: version {shown}, rollouts accepted {accepted}, groups held {held}, "
        f"workers {active} active / {workers} registered; connected: {roles}"
    )


class StatusReporter:
    def __init__(self, context: Context) -> None:
        self.context = context
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="coordinator-status", daemon=True)
        self._said: tuple[str, ...] = ()
        self._said_at = 0.0
        self._status_at = 0.0

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
        roles = tuple(entry["role"] for entry in waiting)
        if roles != self._said or (roles and now - self._said_at >= REPEAT_SECONDS):
            for entry in waiting:
                log.warning("%s", entry["message"])
            if self._said and not roles:
                log.info("no longer waiting for %s", " or ".join(self._said))
            self._said, self._said_at = roles, now
        if now - self._status_at >= STATUS_SECONDS:
            log.info("%s", status_line(self.context))
            self._status_at = now

    def _run(self) -> None:
        while not self._stop.wait(CHECK_SECONDS):
            try:
                self.check()
            except Exception:  # the store was closing, a transient error: try again next time
                log.exception("status check failed")
