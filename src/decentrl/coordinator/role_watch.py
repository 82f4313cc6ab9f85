"""Which trusted roles are connected, and which work waits on one that is not.

The coordinator cannot start a trainer, a verifier or a scorer; it can only say that work waits
for one. Without this, a run started without its verifier froze with every sampled group held
and nothing in any log. A role counts as connected while it has called its routes
(`/v1/trainer/`, `/v1/verifier/`, `/v1/scorer/`) successfully within its `CONNECTED_SECONDS`: each
polls every few seconds while idle. Work that waits on a role that is not connected is reported
in `/v1/stats` (`run`), on the dashboard, in the coordinator's log, and to every trainer and
worker in the `Decentrl-Waiting` header of a 204 answer ("nothing for you yet").
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path

from decentrl.client import RUN_HEADER, WAITING_HEADER
from decentrl.dbapi import Connection
from decentrl.protocol import API_PREFIX


class Role(StrEnum):
    """The trusted roles a run may wait on (they all use the trainer token)."""

    TRAINER = "trainer"
    VERIFIER = "verifier"
    SCORER = "scorer"


CONNECTED_SECONDS = {Role.TRAINER: 300.0, Role.VERIFIER: 30.0, Role.SCORER: 30.0}
"""A role not heard from for this long is not connected. Verifiers and scorers poll every few
seconds while idle. A trainer holding its next batch says nothing while it trains a version, which
takes minutes on a real model (SmolLM2-135M with LoRA on 2 CPU cores: about 45 s), so it is
given longer; a trainer never started is reported at once all the same."""


COMMANDS = {
    Role.TRAINER: "decentrl trainer --coordinator {url} --token=TRAINER_TOKEN --run-dir TRAINER_DIR",
    Role.VERIFIER: "decentrl verifier --coordinator {url} --token=TRAINER_TOKEN",
    Role.SCORER: "decentrl scorer --coordinator {url} --token=TRAINER_TOKEN --reward-model RM_DIR",
}
WORK = {
    Role.TRAINER: ("SELECT COUNT(*) FROM tasks WHERE state = 'ready'", "groups ready to train"),
    Role.VERIFIER: (
        "SELECT COUNT(*) FROM verify_jobs WHERE state = 'pending'",
        "verification jobs pending (their groups are held until verified)",
    ),
    Role.SCORER: (
        "SELECT COUNT(*) FROM reward_pending WHERE state = 'remote'",
        "rollouts waiting for a reward-model score",
    ),
}


def role_of(path: str) -> Role | None:
    for role in Role:
        if path.startswith(f"{API_PREFIX}/{role.value}/"):
            return role
    return None


class RoleWatch:
    """When each role was last heard from, and the last computed list of work waiting on one."""

    def __init__(self, clock: Callable[[], float], run_dir: Path) -> None:
        self.clock = clock
        self.run_dir = run_dir
        self.url = "http://HOST:PORT"
        """The coordinator's URL, once `server.serve` has bound its socket (for the commands)."""
        self.seen: dict[Role, float] = {}
        self.waiting: list[dict] = []
        """The last `refresh`: read by every 204 answer, so no request queries the store for it."""
        self.complete: dict | None = None
        """Once the trainer has published its last version: {"version", "at"} (`run_record.py`)."""
        self.stalled_since: float | None = None
        """When progress stopped, while no role is missing (`status.py`); None while it goes on."""
        self._lock = threading.Lock()

    def saw(self, role: Role) -> None:
        self.seen[role] = self.clock()

    def connected(self) -> dict[str, bool]:
        now = self.clock()
        return {role.value: now - self.seen.get(role, -1e18) < CONNECTED_SECONDS[role] for role in Role}

    def refresh(self, db: Connection) -> list[dict]:
        """Recompute which work waits on a role that is not connected (one COUNT per role)."""
        connected = self.connected()
        waiting = []
        for role, (query, what) in WORK.items():
            if connected[role.value]:
                continue
            count = int(db.execute(query).fetchone()[0] or 0)
            if count:
                waiting.append(self.entry(role, count, what))
        with self._lock:
            self.waiting = waiting
        return waiting

    def entry(self, role: Role, count: int, what: str) -> dict:
        command = COMMANDS[role].format(url=self.url)
        message = (
            f"waiting for a {role}: {count} {what} and no {role} connected; start one with "
            f"`{command}` (TRAINER_TOKEN is in {self.run_dir / 'tokens.json'})"
        )
        return {"role": role.value, "count": count, "command": command, "message": message}

    def header(self) -> dict[str, str]:
        """The header of a 204 answer: that the run is complete, or what it waits on, if anything."""
        if self.complete is not None:
            return {RUN_HEADER: "complete"}
        with self._lock:
            waiting = self.waiting
        if not waiting:
            return {}
        return {WAITING_HEADER: "; ".join(entry["message"] for entry in waiting)}

    def state(self) -> str:
        if self.complete is not None:
            return "complete"
        if self.waiting:
            return "waiting"
        return "running" if self.stalled_since is None else "stalled"


class SeenMiddleware:
    """Marks a role as heard from when one of its routes answers successfully (so only a caller
    holding the trainer token counts)."""

    def __init__(self, app: Callable, watch: RoleWatch) -> None:
        self.app, self.watch = app, watch

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        role = role_of(scope.get("path", "")) if scope["type"] == "http" else None
        if role is None:
            await self.app(scope, receive, send)
            return

        async def watching(message: dict) -> None:
            if message["type"] == "http.response.start" and message["status"] < 400:
                self.watch.saw(role)
            await send(message)

        await self.app(scope, receive, watching)
