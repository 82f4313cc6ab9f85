"""Routes by measured latency: the order among holders (hand-made candidates), a driver's reports
of its hops folded into the store and used for its later routes, and the reports a hostile driver
might send refused or counted once (`coordinator/route_latency.py`, `worker/hop_timer.py`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from pydantic import ValidationError
from test_coordinator_store import Clock
from test_stage_routing import announce, lease, listening, refusal, register, route_of, staged_context

from decentrl.coordinator import route_latency
from decentrl.coordinator.context import Context
from decentrl.coordinator.http.body import describe
from decentrl.coordinator.http.errors import Reason
from decentrl.coordinator.stage_routing import HOLDER_TTL_SECONDS, Candidate, StageHolders, route_order
from decentrl.protocol import MAX_HOP_TIMINGS, MAX_STEP_MS, HopTiming, Lease, LeaseRequest, RouteHop
from decentrl.worker.hop_timer import HopTimer

NEAR_MS, FAR_MS = 20.0, 200.0


def best(*candidates: Candidate) -> str:
    return min(candidates, key=route_order).worker_id


def test_the_nearest_of_the_least_loaded_holders_goes_first() -> None:
    near = Candidate("near", load=0, step_ms=NEAR_MS, tokens_per_second=10.0)
    far = Candidate("far", load=0, step_ms=FAR_MS, tokens_per_second=500.0)
    assert best(far, near) == "near"  # equal load: nearer wins over a higher reported rate
    assert best(replace(near, load=1), far) == "far"  # the near one is busy: load still spreads
    assert best(replace(near, load=1), replace(far, load=1)) == "near"
    new = Candidate("new", load=0, step_ms=None, tokens_per_second=0.0)
    assert best(near, far, new) == "new"  # never measured: tried once, so a fast newcomer is found
    assert best(near, replace(new, load=1)) == "near"  # ... but not before a less loaded one
    assert best(replace(near, worker_id="a"), replace(near, worker_id="b", tokens_per_second=20.0)) == "b"
    assert best(replace(new, worker_id="a"), replace(new, worker_id="b", tokens_per_second=5.0)) == "b"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def store(request: pytest.FixtureRequest) -> str:
    """Both stores (PostgreSQL: a fresh database on a real server, skipped where there is none)."""
    return "sqlite" if request.param == "sqlite" else request.getfixturevalue("postgres_url")


def report(context: Context, driver: str, granted: Lease | None, step_ms: float, steps: int = 12) -> int:
    """The driver's timing of every hop of `granted`, as its next lease request would carry it."""
    assert granted is not None and granted.route
    timings = [
        HopTiming(
            lease_id=granted.lease_id, stage=hop.stage, worker_id=hop.worker_id, steps=steps, step_ms=step_ms
        )
        for hop in granted.route
    ]
    return route_latency.record(context, driver, timings)


def finish_leases(context: Context, *lease_ids: str) -> None:
    """Those leases are done (all leases when none are named): they are no load any more."""
    with context.store.transaction() as db:
        if lease_ids:
            db.executemany("UPDATE leases SET state = 'done' WHERE lease_id = ?", [(i,) for i in lease_ids])
        else:
            db.execute("UPDATE leases SET state = 'done'")


def test_a_driver_goes_to_its_nearest_holder_once_measured_and_elsewhere_when_it_is_busy(
    tmp_path: Path, store: str
) -> None:
    clock = Clock()
    context = staged_context(tmp_path, clock, num_stages=2, store=store)
    holders = StageHolders(context, dial=listening)
    register(context, "near", "far", "new", "d0", "d1")
    announce(holders, "far", 1, [0], 9001, rate=500.0)  # the higher reported rate
    announce(holders, "near", 1, [0], 9002, rate=50.0)
    first = lease(context, "d0", 0)
    assert route_of(first) == ["far"]  # nothing measured: the faster by its word
    assert report(context, "d0", first, FAR_MS) == 1
    second = lease(context, "d0", 0)
    # far carries d0's first lease, still open: a driver's own leases are no load to it (it plays
    # them one after another); near is unmeasured, so it is tried
    assert route_of(second) == ["near"]
    report(context, "d0", second, NEAR_MS)
    assert [route_of(lease(context, "d0", 0)) for _ in range(3)] == [["near"]] * 3
    with context.store.transaction() as db:
        assert route_latency.measured(db, "d0", clock.now) == {"far": FAR_MS, "near": NEAR_MS}

    # d1 measures far, then tries near and holds a lease there: near is busy for d0, which goes far
    finish_leases(context)
    on_far = lease(context, "d1", 0)
    assert route_of(on_far) == ["far"]
    report(context, "d1", on_far, 150.0)
    on_near = lease(context, "d1", 0)
    assert route_of(on_near) == ["near"] and on_far is not None
    finish_leases(context, on_far.lease_id)
    assert route_of(lease(context, "d0", 0)) == ["far"]  # near has one open lease of another driver
    finish_leases(context)
    assert route_of(lease(context, "d0", 0)) == ["near"]

    listed = {holder["worker_id"]: holder["step_ms"] for holder in holders.listing()}
    assert listed["near"] == {"drivers": 1, "median_ms": NEAR_MS, "min_ms": NEAR_MS, "max_ms": NEAR_MS}
    assert listed["far"] == {"drivers": 2, "median_ms": 175.0, "min_ms": 150.0, "max_ms": FAR_MS}

    # a new holder is tried at once (then measured like the others), even by a driver that has a
    # near one
    announce(holders, "new", 1, [0], 9003)
    assert route_of(lease(context, "d0", 0)) == ["new"]
    assert {holder["worker_id"]: holder["step_ms"] for holder in holders.listing()}["new"] is None

    # figures go stale: after STALE_SECONDS every holder is unmeasured again, and tried again
    clock.now += route_latency.STALE_SECONDS + 1
    for port, holder in enumerate(("far", "near", "new"), start=9001):
        announce(holders, holder, 1, [0], port, rate={"far": 500.0, "near": 50.0, "new": 0.0}[holder])
    assert route_of(lease(context, "d0", 0)) == ["far"]
    assert all(holder["step_ms"] is None for holder in holders.listing())


def test_a_figure_is_smoothed_and_a_moved_holder_is_measured_anew(tmp_path: Path) -> None:
    clock = Clock()
    context = staged_context(tmp_path, clock, num_stages=2)
    holders = StageHolders(context, dial=listening)
    register(context, "h", "d0")
    announce(holders, "h", 1, [0], 9001)
    report(context, "d0", lease(context, "d0", 0), 100.0)
    report(context, "d0", lease(context, "d0", 0), 200.0)
    with context.store.transaction() as db:
        # each report moves the figure SMOOTHING of the way
        assert route_latency.measured(db, "d0", clock.now) == {"h": pytest.approx(130.0)}
        row = db.execute("SELECT steps, reports FROM route_latency").fetchone()
    assert (row["steps"], row["reports"]) == (24, 2)
    clock.now += HOLDER_TTL_SECONDS - 1
    announce(holders, "h", 1, [0], 9001)  # the same address: the figure stays
    assert holders.listing()[0]["step_ms"]["median_ms"] == pytest.approx(130.0)
    announce(holders, "h", 1, [0], 9009)  # another address: every driver measures it anew
    assert holders.listing()[0]["step_ms"] is None


def test_reports_of_hops_not_the_drivers_own_are_refused_and_each_hop_counts_once(tmp_path: Path) -> None:
    context = staged_context(tmp_path, Clock(), num_stages=2)
    holders = StageHolders(context, dial=listening)
    register(context, "x", "y", "d0", "d1")
    announce(holders, "x", 1, [0], 9001)
    announce(holders, "y", 1, [0], 9002)
    mine, theirs = lease(context, "d0", 0), lease(context, "d1", 0)
    assert route_of(mine) == ["x"] and route_of(theirs) == ["y"] and mine is not None
    good = HopTiming(lease_id=mine.lease_id, stage=1, worker_id="x", steps=8, step_ms=30.0)
    hostile = {
        "another driver's lease": HopTiming(
            lease_id=theirs.lease_id, stage=1, worker_id="y", steps=8, step_ms=1.0
        ),
        "a holder not on the lease": good.model_copy(update={"worker_id": "y", "step_ms": 1.0}),
        "a stage the route does not have": good.model_copy(update={"stage": 2}),
        "a lease that does not exist": good.model_copy(update={"lease_id": "l-none"}),
    }
    for what, timing in hostile.items():
        # the good entry before it is not stored either: the request is refused whole
        status = refusal(lambda t=timing: route_latency.record(context, "d0", [good, t]))
        assert status == (422, Reason.HOP_TIMING), what
    with context.store.transaction() as db:
        assert db.execute("SELECT COUNT(*) FROM route_latency").fetchone()[0] == 0
        assert [row[0] for row in db.execute("SELECT step_ms FROM lease_routes")] == [None, None]
    assert route_latency.record(context, "d0", [good, good]) == 1  # the same hop twice: once
    assert route_latency.record(context, "d0", [good.model_copy(update={"step_ms": 999.0})]) == 0  # resent
    with context.store.transaction() as db:
        assert route_latency.measured(db, "d0", context.clock()) == {"x": 30.0}


def test_timings_out_of_bounds_are_refused_by_the_schema() -> None:
    good = {"lease_id": "l-1", "stage": 1, "worker_id": "h", "steps": 8, "step_ms": 30.0}

    def refused(*timings: dict) -> str:
        body = {"policy_version": 0, "stage": 0, "hop_timings": list(timings)}
        with pytest.raises(ValidationError) as error:
            LeaseRequest.model_validate(body)
        return describe(error.value)

    assert LeaseRequest.model_validate({"policy_version": 0, "hop_timings": [good]}).hop_timings[0].steps == 8
    assert "hop_timings.0.step_ms: Input should be greater than or equal to 0" in refused(
        good | {"step_ms": -1.0}
    )
    assert "hop_timings.0.step_ms: Input should be less than or equal to" in refused(good | {"step_ms": 1e12})
    assert "hop_timings.0.steps: Input should be greater than or equal to 1" in refused(good | {"steps": 0})
    assert "hop_timings.0.stage" in refused(good | {"stage": 0})
    assert "hop_timings.0.step_ms: Input should be a finite number" in refused(
        good | {"step_ms": float("nan")}
    )
    assert "hop_timings: List should have at most 64 items" in refused(*[good] * (MAX_HOP_TIMINGS + 1))


def test_the_driver_reports_each_hop_of_each_lease_once_with_its_median_bounded() -> None:
    timer = HopTimer()
    hop = RouteHop(stage=1, worker_id="h1", url="http://127.0.0.1:9001", public_key="0" * 64)
    for seconds in (0.010, 0.030, 0.020, 5.0):  # one slow step does not move the median far
        timer.record("l-1", hop, seconds)
    timer.record("l-1", hop.model_copy(update={"stage": 2, "worker_id": "h2"}), 1e6)  # a hung hop
    taken = timer.take()
    assert [(t.lease_id, t.stage, t.worker_id, t.steps) for t in taken] == [
        ("l-1", 1, "h1", 4),
        ("l-1", 2, "h2", 1),
    ]
    assert taken[0].step_ms == pytest.approx(25.0) and taken[1].step_ms == MAX_STEP_MS
    assert timer.take() == []  # sent once
    for number in range(MAX_HOP_TIMINGS + 6):
        timer.record(f"l-{number}", hop, 0.001)
    kept = timer.take()
    assert len(kept) == MAX_HOP_TIMINGS and kept[-1].lease_id == f"l-{MAX_HOP_TIMINGS + 5}"
    LeaseRequest(policy_version=0, stage=0, hop_timings=kept)  # what it sends passes the schema
