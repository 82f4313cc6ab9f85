"""Stage holders and routes: who serves which pipeline stage, and which holders a lease runs through.

In a staged run (`model.num_stages`) no worker holds the whole policy. A holder of stage s >= 1
announces where it serves that stage's steps (`worker/stage_server.py`) and the version it holds.
A worker that holds stage 0 *drives*: it leases tasks like any worker, and with each lease the
coordinator picks a route, one holder per later stage, all at the driver's policy version (pipeline
version v means every stage is at v). Among the live, unquarantined holders of a stage at that
version it takes the least loaded (the fewest open leases of other drivers routed through it: a
driver generates its own leases one after another, so they never contend for a holder), then the
nearest to this driver (its measured decode-step round trip, `route_latency.py`; a holder it has
not measured lately is tried first, so that a new holder gets found), then the fastest by its
reported rate. A route's holders are recorded per lease: a holder serves a driver's steps only for
leases the coordinator routed through it (it asks `/v1/stages/leases/{id}` who drives, with which
key), and its load is counted from them.

A holder that accepts no connections (it announces no address, or the coordinator cannot connect
to the one it announces) is routed as *relayed*: its drivers send its steps through the
coordinator (`stage_relay.py`).

A driver reports a hop that failed (down, refused, a malformed answer). The lease is then expired
at once, so its slots go to the next route (nothing half-generated reaches the trainer: only whole
rollouts are ever submitted), the event is counted by reason, and the holder is left out of routes
until it announces again (`DOWN_SECONDS` at least). A driver can only report holders on its own
open leases.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from fastapi import Depends, FastAPI, Request
from starlette.concurrency import run_in_threadpool

from decentrl.coordinator import route_latency
from decentrl.coordinator.context import Context
from decentrl.coordinator.db.store import STAGE_HOP_FAILED, add_event
from decentrl.coordinator.http.body import parse
from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.coordinator.stage_relay import Relay
from decentrl.coordinator.weights.peers import check_peer_url
from decentrl.dbapi import Connection
from decentrl.protocol import API_PREFIX, RouteHop
from decentrl.stage_wire import StageAnnounce, StageAnnounced, StageLeaseInfo, StageReport

log = logging.getLogger(__name__)

HOLDER_TTL_SECONDS = 30.0
"""A holder not heard from for this long is left out of new routes (holders announce every few s)."""
DOWN_SECONDS = 10.0
"""A holder reported down stays out of routes this long, and then until it announces again."""
DIAL_BACK_SECONDS = 2.0
"""How long the coordinator waits for a connection to an announced address before relaying."""
DIAL_BACK_EVERY_SECONDS = 300.0

CANDIDATES = (
    "SELECT h.worker_id, h.url, k.public_key, h.tokens_per_second, h.held_versions, h.relayed,"
    " (SELECT COUNT(*) FROM lease_routes r JOIN leases l ON l.lease_id = r.lease_id"
    "  WHERE r.worker_id = h.worker_id AND l.state = 'open' AND l.deadline >= ? AND l.worker_id <> ?)"
    " AS load FROM stage_holders h JOIN worker_keys k ON k.worker_id = h.worker_id"
    " LEFT JOIN reputation q ON q.worker_id = h.worker_id"
    # Not down_until <= now: `announce` clears it only once the outage is over, so a holder that
    # died stays out of routes, instead of coming back DOWN_SECONDS later while not yet stale.
    " WHERE h.stage = ? AND h.version >= ? AND h.seen > ? AND h.down_until = 0 AND q.quarantined IS NULL"
)


@dataclass(frozen=True)
class Candidate:
    """A holder that could serve one stage of a driver's next lease."""

    worker_id: str
    load: int
    """Open leases of other drivers routed through it."""
    step_ms: float | None
    """The asking driver's measured decode-step round trip to it; None: not measured lately."""
    tokens_per_second: float
    """Its self-reported rate."""


def route_order(candidate: Candidate) -> tuple:
    """The sort key of `pick_route`: the least loaded first, so that load spreads; among equals, an
    unmeasured holder first (tried once, then it is measured), then the nearest, then the fastest.
    With K stages a token costs K round trips, so the nearest equally loaded holder is the one a
    driver on a WAN wants; a busier near holder still loses to an idle far one."""
    measured = candidate.step_ms is not None
    return (
        candidate.load,
        measured,
        candidate.step_ms or 0.0,
        -candidate.tokens_per_second,
        candidate.worker_id,
    )


def check_stage(context: Context, stage: int | None, role: str) -> None:
    """Refuse a stage that the run's map does not have (or any stage in an unstaged run)."""
    stage_map = context.stage_map
    if stage is None:
        return
    if stage_map is None:
        raise ApiError(422, f"{role} names stage {stage}, but this run is not staged", Reason.STAGE)
    if not 0 <= stage < stage_map.num_stages:
        detail = (
            f"{role} names stage {stage}; this run's stages are 0-{stage_map.last} ({stage_map.describe()})"
        )
        raise ApiError(422, detail, Reason.STAGE)


def pick_route(
    db: Connection, context: Context, driver_id: str, version: int, now: float
) -> list[RouteHop] | None:
    """One holder per stage after the first, all at `version`, in `route_order` for `driver_id`;
    None when some stage has none."""
    stage_map = context.stage_map
    assert stage_map is not None
    step_ms = route_latency.measured(db, driver_id, now)
    route = []
    for stage in range(1, stage_map.num_stages):
        query = (now, driver_id, stage, version, now - HOLDER_TTL_SECONDS)
        rows = [r for r in db.execute(CANDIDATES, query) if version in json.loads(r["held_versions"])]
        if not rows:
            return None
        candidates = [
            Candidate(r["worker_id"], r["load"], step_ms.get(r["worker_id"]), r["tokens_per_second"])
            for r in rows
        ]
        row = rows[candidates.index(min(candidates, key=route_order))]
        relayed = bool(row["relayed"])
        url = None if relayed else row["url"]
        route.append(RouteHop(stage=stage, worker_id=row[0], url=url, public_key=row[2], relayed=relayed))
    return route


def record_route(db: Connection, lease_id: str, route: list[RouteHop], version: int) -> None:
    db.executemany(
        "INSERT INTO lease_routes (lease_id, stage, worker_id, version) VALUES (?, ?, ?, ?)",
        [(lease_id, hop.stage, hop.worker_id, version) for hop in route],
    )


def reachable(url: str, timeout: float = DIAL_BACK_SECONDS) -> bool:
    """Whether a TCP connection to `url`'s host and port opens: the coordinator's dial-back test of
    an announced address (what libp2p's AutoNAT asks of peers). A holder behind NAT announces an
    address nobody outside can connect to."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout):
            return True
    except OSError:
        return False


class StageHolders:
    def __init__(self, context: Context, relay: Relay | None = None, dial: Callable[[str], bool] = reachable):
        self.context = context
        self.relay = relay
        self.dial = dial
        self.networks = [ipaddress.ip_network(net) for net in context.run.weights.peer_networks]
        self.dialed: dict[tuple[str, str], tuple[bool, float]] = {}
        """(holder, url) -> (reachable, when tested): each announced address is tested once per
        `DIAL_BACK_EVERY_SECONDS`, not at every announcement."""

    def relayed(self, worker_id: str, url: str | None) -> bool:
        """Drivers reach this holder through the relay: no address, or one that did not answer."""
        if url is None:
            return True
        now = time.monotonic()
        known = self.dialed.get((worker_id, url))
        if known is None or now - known[1] > DIAL_BACK_EVERY_SECONDS:
            known = (self.dial(url), now)
            self.dialed[(worker_id, url)] = known
            if not known[0]:
                log.warning(
                    "stage holder %s announced %s, which does not accept connections: relayed", worker_id, url
                )
        return not known[0]

    def announce(self, worker_id: str, body: StageAnnounce) -> StageAnnounced:
        check_stage(self.context, body.stage, "the announced holder")
        if body.url is not None:
            check_peer_url(body.url, self.networks)
        relayed = self.relayed(worker_id, body.url)  # before the transaction: it may wait for a connect
        now = self.context.clock()
        with self.context.store.transaction() as db:
            latest = db.execute("SELECT MAX(version) FROM weights").fetchone()[0]
            if body.version > (-1 if latest is None else latest):  # a claim above every version is a lie
                detail = f"holder version {body.version} is above the latest published one ({latest})"
                raise ApiError(422, detail, Reason.UNKNOWN_VERSION)
            held = sorted({*body.held_versions, body.version})
            route_latency.forget_if_moved(db, worker_id, body.url or "", relayed)
            # An announcement ends a reported outage once DOWN_SECONDS have passed.
            db.execute(
                "INSERT INTO stage_holders (worker_id, stage, url, version, held_versions, tokens_per_second,"
                " seen, relayed) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (worker_id) DO UPDATE SET"
                " stage = excluded.stage, url = excluded.url, version = excluded.version,"
                " held_versions = excluded.held_versions, relayed = excluded.relayed,"
                " tokens_per_second = excluded.tokens_per_second, seen = excluded.seen,"
                " down_until = CASE WHEN stage_holders.down_until > excluded.seen"
                " THEN stage_holders.down_until ELSE 0 END",
                (
                    worker_id,
                    body.stage,
                    body.url or "",
                    body.version,
                    json.dumps(held),
                    body.tokens_per_second,
                    now,
                    int(relayed),
                ),
            )
        return StageAnnounced(stage=body.stage, version=body.version, relayed=relayed)

    def lease_info(self, holder_id: str, lease_id: str) -> StageLeaseInfo:
        """Who drives `lease_id`, for a holder on its route (404 to anyone else: no lease is revealed)."""
        with self.context.store.transaction() as db:
            hops = db.execute(
                "SELECT stage, version FROM lease_routes WHERE lease_id = ? AND worker_id = ? ORDER BY stage",
                (lease_id, holder_id),
            ).fetchall()
            lease = db.execute(
                "SELECT l.worker_id, l.deadline, l.state, k.public_key FROM leases l"
                " JOIN worker_keys k ON k.worker_id = l.worker_id WHERE l.lease_id = ?",
                (lease_id,),
            ).fetchone()
        if not hops or lease is None:
            raise ApiError(404, f"no lease {lease_id!r} routed through this holder", Reason.UNKNOWN_LEASE)
        if lease["state"] != "open":
            raise ApiError(410, f"lease {lease_id!r} is {lease['state']}", Reason.LEASE_EXPIRED)
        return StageLeaseInfo(
            lease_id=lease_id,
            driver_id=lease["worker_id"],
            driver_public_key=lease["public_key"],
            version=hops[0]["version"],
            deadline_unix=lease["deadline"],
            stages=[hop["stage"] for hop in hops],
        )

    def report(self, driver_id: str, body: StageReport) -> dict:
        """A failed hop of the driver's own open lease: expire the lease, count the reason, and
        keep the holder out of routes for a while."""
        now = self.context.clock()
        with self.context.store.transaction() as db:
            hop = db.execute(
                "SELECT 1 FROM lease_routes r JOIN leases l ON l.lease_id = r.lease_id"
                " WHERE r.lease_id = ? AND r.stage = ? AND r.worker_id = ? AND l.worker_id = ?"
                " AND l.state = 'open'",
                (body.lease_id, body.stage, body.worker_id, driver_id),
            ).fetchone()
            if hop is None:
                detail = f"stage {body.stage} of an open lease {body.lease_id!r} of yours is not {body.worker_id!r}"
                raise ApiError(404, detail, Reason.UNKNOWN_LEASE)
            db.execute("UPDATE leases SET state = 'expired' WHERE lease_id = ?", (body.lease_id,))
            db.execute(
                "UPDATE slots SET lease_id = NULL WHERE lease_id = ? AND rollout_id IS NULL", (body.lease_id,)
            )
            if body.reason != "version_mismatch":  # a version it dropped: it is up, and says what it holds
                db.execute(
                    "UPDATE stage_holders SET down_until = ? WHERE worker_id = ?",
                    (now + DOWN_SECONDS, body.worker_id),
                )
            reason = f"{body.reason}: stage {body.stage} on lease {body.lease_id} ({body.detail})"
            add_event(db, now, STAGE_HOP_FAILED, body.worker_id, reason)
        self.context.room.notify()  # the freed slots may be leased at once
        return {"expired": body.lease_id}

    def listing(self) -> list[dict]:
        """Every holder heard from lately, for the dashboard and `decentrl status`, with the step
        round trips its drivers measured (`route_latency.seen_by_drivers`; None: none lately)."""
        now = self.context.clock()
        with self.context.store.transaction() as db:
            rows = db.execute(
                "SELECT worker_id, stage, url, version, held_versions, tokens_per_second, seen, down_until,"
                " relayed FROM stage_holders WHERE seen > ? ORDER BY stage, worker_id",
                (now - HOLDER_TTL_SECONDS,),
            ).fetchall()
            step_ms = route_latency.seen_by_drivers(db, now)
        listed = [
            dict(row) | {"relayed": bool(row["relayed"]), "step_ms": step_ms.get(row["worker_id"])}
            for row in rows
        ]
        if self.relay is not None:
            for holder in listed:
                holder["relay_connected"] = holder["relayed"] and self.relay.connected(holder["worker_id"])
        return listed


def add_stage_routes(
    app: FastAPI, context: Context, worker: Callable, client: Callable, relay: Relay | None = None
) -> StageHolders:
    holders = StageHolders(context, relay)
    limit = context.config.max_body_bytes

    @app.post(f"{API_PREFIX}/stages/announce")
    async def announce(request: Request, worker_id: str = Depends(worker)) -> dict:
        body = await parse(request, StageAnnounce, limit)
        return (await run_in_threadpool(holders.announce, worker_id, body)).model_dump()

    @app.get(f"{API_PREFIX}/stages/leases/{{lease_id}}")
    def lease_info(lease_id: str, worker_id: str = Depends(worker)) -> dict:
        return holders.lease_info(worker_id, lease_id).model_dump()

    @app.post(f"{API_PREFIX}/stages/report")
    async def report(request: Request, worker_id: str = Depends(worker)) -> dict:
        return holders.report(worker_id, await parse(request, StageReport, limit))

    @app.get(f"{API_PREFIX}/stages", dependencies=[Depends(client)])
    def listing() -> dict:
        stage_map = context.stage_map
        return {
            "stage_map": None if stage_map is None else stage_map.model_dump(),
            "holders": holders.listing(),
            "relay": None if relay is None else relay.stats(),
        }

    return holders
