"""Measured routes: how long each driver waits on each stage holder per decode step.

A driver times the decode steps of every hop of its leases and reports, with its next lease
request, one `HopTiming` per hop: the median round trip and the number of steps
(`worker/hop_timer.py`). The coordinator takes an entry only for a hop it routed one of that
driver's own leases through, and only once per leased hop (a resent request folds nothing in
twice), and keeps per (driver, holder) an exponentially weighted mean: each report moves it
`SMOOTHING` of the way. `stage_routing.pick_route` prefers, among equally loaded holders, the one
with the shortest wait for the driver asking.

A figure not refreshed for `STALE_SECONDS` counts as unmeasured again, and a holder that announces
another address (or is now relayed, or no longer) is measured anew: a link that was slow once is
tried again some time later instead of being avoided for good.

Trust: a report is the driver's own word, so it steers only that driver's routes, and only among
equally loaded holders. Lying costs the liar speed, or sends its leases to a holder it prefers no
sooner than load allows, where every step is still committed and checked. The schema bounds each
value (`protocol.MAX_STEP_MS`) and the number of entries (`MAX_HOP_TIMINGS`); an entry naming a
hop that was not the driver's own refuses the whole request (422 `hop_timing`), storing nothing.
"""

from __future__ import annotations

import statistics

from decentrl.coordinator.context import Context
from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.dbapi import Connection
from decentrl.protocol import HopTiming

SMOOTHING = 0.3
"""The weight of a new report in a (driver, holder) figure; each report is already a lease's median."""
STALE_SECONDS = 1800.0
"""A figure older than this counts as unmeasured: the holder is tried again (once) at equal load.
Long enough that re-trying a far holder costs a driver a few percent of its leases at most."""

OWN_HOP = (
    "SELECT r.step_ms FROM lease_routes r JOIN leases l ON l.lease_id = r.lease_id"
    " WHERE r.lease_id = ? AND r.stage = ? AND r.worker_id = ? AND l.worker_id = ?"
)
FOLD_IN = (
    "INSERT INTO route_latency (driver_id, holder_id, step_ms, steps, reports, updated)"
    " VALUES (?, ?, ?, ?, 1, ?) ON CONFLICT (driver_id, holder_id) DO UPDATE SET"
    " step_ms = CASE WHEN route_latency.updated < ? THEN excluded.step_ms"
    " ELSE route_latency.step_ms + ? * (excluded.step_ms - route_latency.step_ms) END,"
    " steps = route_latency.steps + excluded.steps, reports = route_latency.reports + 1,"
    " updated = excluded.updated"
)


def record(context: Context, driver_id: str, timings: list[HopTiming]) -> int:
    """Fold a driver's hop timings into its figures; returns how many were new. 422 `hop_timing`
    (nothing stored) when one names a hop that no lease of this driver's was routed through."""
    now = context.clock()
    folded = 0
    with context.store.transaction() as db:
        for index, timing in enumerate(timings):
            hop = db.execute(OWN_HOP, (timing.lease_id, timing.stage, timing.worker_id, driver_id)).fetchone()
            if hop is None:
                detail = (
                    f"hop_timings[{index}] names holder {timing.worker_id!r} at stage {timing.stage} of lease"
                    f" {timing.lease_id!r}, which is not a hop of a lease of yours; report only your own routes"
                )
                raise ApiError(422, detail, Reason.HOP_TIMING)
            if hop["step_ms"] is not None:  # reported already (a retried request): counted once
                continue
            db.execute(
                "UPDATE lease_routes SET step_ms = ? WHERE lease_id = ? AND stage = ?",
                (timing.step_ms, timing.lease_id, timing.stage),
            )
            values = (driver_id, timing.worker_id, timing.step_ms, timing.steps, now)
            db.execute(FOLD_IN, (*values, now - STALE_SECONDS, SMOOTHING))
            folded += 1
    return folded


def measured(db: Connection, driver_id: str, now: float) -> dict[str, float]:
    """The driver's fresh figures: holder -> smoothed decode-step round trip in ms."""
    rows = db.execute(
        "SELECT holder_id, step_ms FROM route_latency WHERE driver_id = ? AND updated >= ?",
        (driver_id, now - STALE_SECONDS),
    )
    return {row["holder_id"]: row["step_ms"] for row in rows}


def forget_if_moved(db: Connection, holder_id: str, url: str, relayed: bool) -> None:
    """Before an announcement is stored: a holder at another address, or reached another way
    (relayed or direct), is measured anew by every driver."""
    db.execute(
        "DELETE FROM route_latency WHERE holder_id = ? AND EXISTS (SELECT 1 FROM stage_holders"
        " WHERE worker_id = ? AND (url <> ? OR relayed <> ?))",
        (holder_id, holder_id, url, int(relayed)),
    )


def seen_by_drivers(db: Connection, now: float) -> dict[str, dict]:
    """Per holder, its drivers' fresh figures: how many drivers, their median, fastest and slowest
    (ms per decode step). A holder no driver measured lately is absent."""
    figures: dict[str, list[float]] = {}
    for row in db.execute(
        "SELECT holder_id, step_ms FROM route_latency WHERE updated >= ?", (now - STALE_SECONDS,)
    ):
        figures.setdefault(row["holder_id"], []).append(row["step_ms"])
    return {
        holder: {
            "drivers": len(ms),
            "median_ms": round(statistics.median(ms), 3),
            "min_ms": round(min(ms), 3),
            "max_ms": round(max(ms), 3),
        }
        for holder, ms in figures.items()
    }
