"""Env servers and the episodes they run: who serves the run's environment, which episode a leased
slot may play, and what failed (docs/environments.md, "Served environments").

An env server (trusted: trainer token) announces itself every few seconds with its URL and signing
key. Before it opens an episode it asks for it: the coordinator grants an episode of an open slot
of the lease only if the slot has none yet, or all of its episodes failed and fewer than
`task.max_env_retries` retries were granted. It records the episode with the key of the server
that will sign it, so that ingestion (`pipeline/served.py`) knows which key must have signed a
rollout's turns, and that a worker cannot play a slot twice and keep the better episode.

A failure (crash, timeout, memory, error) is reported by the server at once: it is counted (an
`env_failed` event by reason), the slot may be retried, and after its last retry the slot leaves
the lease and is leased again. A task whose episodes failed `task.max_env_failures` times is given
up (state `env_failed`): never trained. An episode left open on a server that stopped announcing
is failed as `lost` when the slot asks for its next one.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable

from fastapi import Depends, FastAPI, Request

from decentrl.coordinator.context import Context
from decentrl.coordinator.db.store import ENV_FAILED, add_event
from decentrl.coordinator.http.body import parse
from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.dbapi import Connection
from decentrl.envd_wire import (
    EnvFailure,
    EnvLeaseInfo,
    EnvServerAnnounce,
    EnvServerInfo,
    EpisodeClaim,
    EpisodeFailed,
    EpisodeGrant,
)
from decentrl.protocol import API_PREFIX

SERVER_TTL_SECONDS = 15.0
"""A server not heard from for this long is left out of the list workers get; its open episodes
may be failed as `lost`."""


def _lease(db: Connection, lease_id: str, now: float):  # noqa: ANN202 - a row
    lease = db.execute(
        "SELECT l.worker_id, l.deadline, l.state, k.public_key FROM leases l"
        " LEFT JOIN worker_keys k ON k.worker_id = l.worker_id WHERE l.lease_id = ?",
        (lease_id,),
    ).fetchone()
    if lease is None:
        raise ApiError(404, f"no lease {lease_id!r}", Reason.UNKNOWN_LEASE)
    if lease["state"] != "open" or lease["deadline"] < now:
        raise ApiError(410, f"lease {lease_id!r} is not open", Reason.LEASE_EXPIRED)
    if lease["public_key"] is None:
        detail = "a served environment needs workers that sign their requests (trust.signed_requests)"
        raise ApiError(409, detail, Reason.CONFLICT)
    return lease


class EnvServers:
    def __init__(self, context: Context):
        self.context = context

    def announce(self, body: EnvServerAnnounce) -> dict:
        with self.context.store.transaction() as db:
            db.execute(
                "INSERT INTO env_servers (server_id, url, public_key, env, env_version, sessions, open_episodes,"
                " counters, seen) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (server_id) DO UPDATE SET"
                " url = excluded.url, public_key = excluded.public_key, env = excluded.env,"
                " env_version = excluded.env_version, sessions = excluded.sessions,"
                " open_episodes = excluded.open_episodes, counters = excluded.counters, seen = excluded.seen",
                (
                    body.server_id,
                    body.url,
                    body.public_key,
                    body.env,
                    body.env_version,
                    body.sessions,
                    body.open_episodes,
                    json.dumps(body.counters),
                    self.context.clock(),
                ),
            )
        return {"server_id": body.server_id}

    def live(self) -> list[EnvServerInfo]:
        cutoff = self.context.clock() - SERVER_TTL_SECONDS
        with self.context.store.transaction() as db:
            rows = db.execute(
                "SELECT server_id, url, env, env_version, sessions FROM env_servers WHERE seen > ?"
                " AND env = ? ORDER BY server_id",
                (cutoff, self.context.run.task.env),
            ).fetchall()
        return [EnvServerInfo(**dict(row)) for row in rows]

    def lease_info(self, lease_id: str) -> EnvLeaseInfo:
        with self.context.store.transaction() as db:
            lease = _lease(db, lease_id, self.context.clock())
        return EnvLeaseInfo(
            lease_id=lease_id,
            worker_id=lease["worker_id"],
            worker_public_key=lease["public_key"],
            deadline_unix=lease["deadline"],
        )

    def claim(self, body: EpisodeClaim) -> EpisodeGrant:
        now, task_config = self.context.clock(), self.context.run.task
        with self.context.store.transaction() as db:
            server = db.execute(
                "SELECT public_key FROM env_servers WHERE server_id = ?", (body.server_id,)
            ).fetchone()
            if server is None:
                raise ApiError(
                    409, f"env server {body.server_id!r} has not announced itself", Reason.CONFLICT
                )
            _lease(db, body.lease_id, now)
            slot = db.execute(
                "SELECT s.rollout_id, t.env, t.seed, t.state FROM lease_slots ls"
                " JOIN slots s ON s.task_id = ls.task_id AND s.slot = ls.slot JOIN tasks t ON t.task_id = ls.task_id"
                " WHERE ls.lease_id = ? AND ls.task_id = ? AND ls.slot = ?",
                (body.lease_id, body.task_id, body.slot),
            ).fetchone()
            if slot is None:
                detail = f"task {body.task_id!r} slot {body.slot} is not part of lease {body.lease_id!r}"
                raise ApiError(422, detail, Reason.NOT_LEASED)
            if slot["rollout_id"] is not None or slot["state"] != "pending":
                raise ApiError(409, f"task {body.task_id!r} slot {body.slot} is done", Reason.DUPLICATE)
            attempts = self._earlier(db, body, now)
            if attempts > task_config.max_env_retries:
                detail = f"slot {body.slot} of task {body.task_id!r} failed {attempts} times on this lease"
                raise ApiError(409, detail, Reason.CONFLICT)
            episode_id = f"e-{secrets.token_hex(8)}"
            db.execute(
                "INSERT INTO env_episodes (episode_id, lease_id, task_id, slot, attempt, server_id, server_key,"
                " env_version, state, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'open', ?)",
                (
                    episode_id,
                    body.lease_id,
                    body.task_id,
                    body.slot,
                    attempts,
                    body.server_id,
                    server["public_key"],
                    body.env_version,
                    now,
                ),
            )
        return EpisodeGrant(episode_id=episode_id, attempt=attempts, env=slot["env"], seed=slot["seed"])

    def _earlier(self, db: Connection, body: EpisodeClaim, now: float) -> int:
        """How many episodes the slot had on this lease (each must have failed: an open one on a
        server that stopped announcing is failed as lost); 409 when one is still going."""
        rows = db.execute(
            "SELECT e.episode_id, e.state, s.seen FROM env_episodes e LEFT JOIN env_servers s"
            " ON s.server_id = e.server_id WHERE e.lease_id = ? AND e.task_id = ? AND e.slot = ?",
            (body.lease_id, body.task_id, body.slot),
        ).fetchall()
        for row in rows:
            if row["state"] == "failed":
                continue
            if row["seen"] is not None and row["seen"] > now - SERVER_TTL_SECONDS:
                detail = f"slot {body.slot} of task {body.task_id!r} has episode {row['episode_id']} already"
                raise ApiError(409, detail, Reason.DUPLICATE)
            self._fail(db, row["episode_id"], EnvFailure.LOST, now)
        return len(rows)

    def failed(self, body: EpisodeFailed) -> dict:
        with self.context.store.transaction() as db:
            row = db.execute(
                "SELECT server_id FROM env_episodes WHERE episode_id = ?", (body.episode_id,)
            ).fetchone()
            if row is None or row["server_id"] != body.server_id:
                raise ApiError(
                    404, f"no episode {body.episode_id!r} of server {body.server_id!r}", Reason.UNKNOWN
                )
            released = self._fail(db, body.episode_id, body.failure, self.context.clock())
        if released:
            self.context.room.notify()  # the slot may be leased again at once
        return {"episode_id": body.episode_id, "released": released}

    def _fail(self, db: Connection, episode_id: str, failure: EnvFailure, now: float) -> bool:
        """Mark an episode failed (once), count it; True when its slot left the lease (no retry left)."""
        episode = db.execute(
            "SELECT e.*, l.worker_id FROM env_episodes e JOIN leases l ON l.lease_id = e.lease_id"
            " WHERE e.episode_id = ?",
            (episode_id,),
        ).fetchone()
        if episode["state"] == "failed":
            return False
        task_config = self.context.run.task
        db.execute(
            "UPDATE env_episodes SET state = 'failed', reason = ? WHERE episode_id = ?",
            (failure.value, episode_id),
        )
        add_event(db, now, ENV_FAILED, episode["worker_id"], failure.value)
        db.execute(
            "UPDATE tasks SET env_failures = env_failures + 1 WHERE task_id = ?", (episode["task_id"],)
        )
        failures = db.execute(
            "SELECT env_failures FROM tasks WHERE task_id = ?", (episode["task_id"],)
        ).fetchone()[0]
        if failures >= task_config.max_env_failures:
            given_up = db.execute(
                "UPDATE tasks SET state = 'env_failed' WHERE task_id = ? AND state = 'pending'",
                (episode["task_id"],),
            )
            if given_up.rowcount:
                add_event(db, now, ENV_FAILED, None, f"task {episode['task_id']} given up")
        if episode["attempt"] < task_config.max_env_retries:
            return False
        # No retry left on this lease: the slot leaves it and is leased again (to anyone).
        db.execute(
            "DELETE FROM lease_slots WHERE lease_id = ? AND task_id = ? AND slot = ?",
            (episode["lease_id"], episode["task_id"], episode["slot"]),
        )
        db.execute(
            "UPDATE slots SET lease_id = NULL WHERE task_id = ? AND slot = ? AND lease_id = ? AND rollout_id IS NULL",
            (episode["task_id"], episode["slot"], episode["lease_id"]),
        )
        return True


def granted_episodes(db: Connection, episode_ids: list[str]) -> dict[str, dict]:
    """The granted episodes among `episode_ids`, by id (ingestion's view)."""
    if not episode_ids:
        return {}
    marks = ",".join("?" * len(episode_ids))
    rows = db.execute(f"SELECT * FROM env_episodes WHERE episode_id IN ({marks})", tuple(episode_ids))
    return {row["episode_id"]: dict(row) for row in rows}


def summary(db: Connection, now: float) -> dict:
    """The `envd` section of /v1/stats: servers, episodes by state, failures by reason, tasks given up."""
    servers = db.execute(
        "SELECT server_id, url, env_version, sessions, open_episodes, counters, seen FROM env_servers ORDER BY server_id"
    ).fetchall()
    failures = {
        row["reason"]: row["n"]
        for row in db.execute(
            "SELECT reason, COUNT(*) AS n FROM env_episodes WHERE state = 'failed' GROUP BY reason ORDER BY reason"
        )
    }
    episodes = {
        row["state"]: row["n"]
        for row in db.execute("SELECT state, COUNT(*) AS n FROM env_episodes GROUP BY state")
    }
    retried = db.execute("SELECT COUNT(*) FROM env_episodes WHERE attempt > 0").fetchone()[0]
    given_up = db.execute("SELECT COUNT(*) FROM tasks WHERE state = 'env_failed'").fetchone()[0]
    return {
        "servers": [
            {
                "server_id": row["server_id"],
                "url": row["url"],
                "env_version": row["env_version"],
                "sessions": row["sessions"],
                "open_episodes": row["open_episodes"],
                "live": row["seen"] > now - SERVER_TTL_SECONDS,
                "counters": json.loads(row["counters"]),
            }
            for row in servers
        ],
        "episodes": episodes,
        "failures": failures,
        "retries": int(retried),
        "tasks_given_up": int(given_up),
    }


def add_envd_routes(app: FastAPI, context: Context, trainer: Callable, client: Callable) -> EnvServers:
    servers = EnvServers(context)
    limit = context.config.max_body_bytes

    @app.put(f"{API_PREFIX}/envd/servers", dependencies=[Depends(trainer)])
    async def announce(request: Request) -> dict:
        return servers.announce(await parse(request, EnvServerAnnounce, limit))

    @app.get(f"{API_PREFIX}/envd/servers", dependencies=[Depends(client)])
    def listing() -> dict:
        return {"servers": [server.model_dump() for server in servers.live()]}

    @app.get(f"{API_PREFIX}/envd/leases/{{lease_id}}", dependencies=[Depends(trainer)])
    def lease_info(lease_id: str) -> dict:
        return servers.lease_info(lease_id).model_dump()

    @app.post(f"{API_PREFIX}/envd/episodes", dependencies=[Depends(trainer)])
    async def claim(request: Request) -> dict:
        return servers.claim(await parse(request, EpisodeClaim, limit)).model_dump()

    @app.post(f"{API_PREFIX}/envd/failures", dependencies=[Depends(trainer)])
    async def failed(request: Request) -> dict:
        return servers.failed(await parse(request, EpisodeFailed, limit))

    app.state.env_servers = servers
    return servers
