"""The coordinator's routes through stage holders, on a real SQLite store without HTTP: which
holders a driver's lease goes through, who may learn of a lease, who may report a failed hop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_coordinator_store import Clock, publish_row, write_model_dir

from decentrl.config import LOOPBACK_NETWORKS, CoordinatorConfig, ModelConfig, RunConfig, WeightsConfig
from decentrl.coordinator.context import Context, build_context
from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.coordinator.pipeline import leasing
from decentrl.coordinator.stage_routing import DOWN_SECONDS, HOLDER_TTL_SECONDS, StageHolders
from decentrl.protocol import Lease, LeaseRequest
from decentrl.stage_wire import StageAnnounce, StageReport


def staged_context(
    tmp_path: Path, clock: Clock, num_stages: int | None, num_layers: int = 2, store: str = "sqlite"
) -> Context:
    """A run over a `num_layers`-layer model (tied embeddings) in `num_stages` stages (None: unstaged),
    its state in `store` (a PostgreSQL URL, or "sqlite")."""
    tmp_path.mkdir(exist_ok=True)
    model_dir = write_model_dir(tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    config.update(num_hidden_layers=num_layers, tie_word_embeddings=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    run = RunConfig(
        model=ModelConfig(num_stages=num_stages),
        coordinator=CoordinatorConfig(group_size=2, max_pending_groups=32, lease_seconds=10, store=store),
        weights=WeightsConfig(peer_networks=LOOPBACK_NETWORKS),
    )
    context = build_context(run, tmp_path / "run", model_dir, clock)
    for version in range(4):
        publish_row(context, version)
    return context


def listening(url: str) -> bool:
    """The coordinator's dial-back, answered yes: these holders' ports are made up, not opened."""
    return True


def register(context: Context, *worker_ids: str) -> None:
    with context.store.transaction() as db:
        for worker_id in worker_ids:
            public_key = f"{len(worker_id):02x}{worker_id.encode().hex()}".ljust(64, "0")[:64]
            db.execute(
                "INSERT INTO worker_keys (worker_id, public_key, address, registered) VALUES (?, ?, NULL, 0)",
                (worker_id, public_key),
            )


def announce(
    holders: StageHolders, worker_id: str, stage: int, held: list[int], port: int, rate: float = 0.0
) -> None:
    body = StageAnnounce(
        stage=stage,
        url=f"http://127.0.0.1:{port}",
        version=max(held),
        held_versions=held,
        tokens_per_second=rate,
    )
    holders.announce(worker_id, body)


def lease(context: Context, driver: str, version: int) -> Lease | None:
    return leasing.grant_lease(context, driver, LeaseRequest(policy_version=version, max_groups=1, stage=0))


def route_of(found: Lease | None) -> list[str] | None:
    return None if found is None else [hop.worker_id for hop in found.route or []]


def refusal(call) -> tuple[int, Reason]:
    with pytest.raises(ApiError) as error:
        call()
    return error.value.status, error.value.reason


def test_a_route_goes_through_holders_of_its_version_at_every_stage(tmp_path: Path) -> None:
    context = staged_context(tmp_path, Clock(), num_stages=3, num_layers=3)
    holders = StageHolders(context, dial=listening)
    register(context, "a1", "b1", "a2", *(f"d{i}" for i in range(5)))
    announce(holders, "a1", 1, [0, 2], 9001)  # skipped v1 (it fetched the latest, v2)
    announce(holders, "b1", 1, [1, 2], 9002)
    announce(holders, "a2", 2, [0, 1, 2], 9003)
    assert route_of(lease(context, "d0", 0)) == ["a1", "a2"]
    assert route_of(lease(context, "d1", 1)) == ["b1", "a2"]  # a1 is not on v1
    assert route_of(lease(context, "d2", 2)) == ["a1", "a2"]  # equal loads: a1 < b1
    # no holder of stage 2 holds v3: no route, and so no lease (its slots stay free)
    announce(holders, "b1", 1, [1, 2, 3], 9002)
    assert lease(context, "d3", 3) is None
    announce(holders, "a2", 2, [1, 2, 3], 9003)
    found = lease(context, "d3", 3)
    assert route_of(found) == ["b1", "a2"] and found is not None and found.policy_version == 3
    assert [(hop.stage, hop.url) for hop in found.route or []] == [
        (1, "http://127.0.0.1:9002"),
        (2, "http://127.0.0.1:9003"),
    ]
    assert lease(context, "d4", 0) is None  # a2 no longer holds v0


def test_routes_balance_by_open_leases_then_rate(tmp_path: Path) -> None:
    clock = Clock()
    context = staged_context(tmp_path, clock, num_stages=2)
    holders = StageHolders(context, dial=listening)
    register(context, "slow", "fast", *(f"d{i}" for i in range(4)))
    announce(holders, "slow", 1, [0], 9001, rate=10.0)
    announce(holders, "fast", 1, [0], 9002, rate=50.0)
    assert route_of(lease(context, "d0", 0)) == ["fast"]  # no load on either: the faster
    assert route_of(lease(context, "d1", 0)) == ["slow"]  # fast carries one open lease
    assert route_of(lease(context, "d2", 0)) == ["fast"]  # one each: the faster again
    with context.store.transaction() as db:  # slow's lease is done: only open leases are load
        db.execute("UPDATE leases SET state = 'done' WHERE worker_id = 'd1'")
    assert route_of(lease(context, "d3", 0)) == ["slow"]  # fast carries two
    clock.now += 11  # past every deadline (10 s leases): no load left anywhere
    assert route_of(lease(context, "d0", 0)) == ["fast"]


def test_quarantined_stale_and_reported_holders_are_in_no_route(tmp_path: Path) -> None:
    clock = Clock()
    context = staged_context(tmp_path, clock, num_stages=2)
    holders = StageHolders(context, dial=listening)
    register(context, "bad", "old", "down", "good", *(f"d{i}" for i in range(6)))
    announce(holders, "old", 1, [0], 9001, rate=400.0)  # the fastest, but falls silent
    clock.now += HOLDER_TTL_SECONDS - 1
    for port, holder in enumerate(("bad", "down", "good"), start=9002):
        announce(holders, holder, 1, [0], port, rate={"bad": 300.0, "down": 200.0, "good": 1.0}[holder])
    with context.store.transaction() as db:
        db.execute(
            "INSERT INTO reputation (worker_id, quarantined, reason) VALUES ('bad', ?, 'x')", (clock.now,)
        )
    assert route_of(lease(context, "d0", 0)) == ["old"]  # heard from 29 s ago: still in
    clock.now += 2
    through_down = lease(context, "d1", 0)  # old is stale now, bad is quarantined
    assert route_of(through_down) == ["down"] and through_down is not None
    holders.report(
        "d1", StageReport(lease_id=through_down.lease_id, stage=1, worker_id="down", reason="unreachable")
    )
    assert route_of(lease(context, "d2", 0)) == ["good"]
    assert route_of(lease(context, "d3", 0)) == ["good"]  # down has no open lease, yet stays out
    # announcing again during the outage does not end it; silence after it neither (a dead holder
    # is not yet stale); the first announcement after it does
    clock.now += DOWN_SECONDS - 1
    announce(holders, "down", 1, [0], 9003, rate=200.0)
    assert route_of(lease(context, "d4", 0)) == ["good"]
    clock.now += 2
    assert route_of(lease(context, "d4", 0)) == ["good"]
    announce(holders, "down", 1, [0], 9003, rate=200.0)
    assert route_of(lease(context, "d5", 0)) == ["down"]
    assert [row["worker_id"] for row in holders.listing()] == ["bad", "down", "good"]  # old forgotten


def test_stages_the_run_does_not_have_are_refused(tmp_path: Path) -> None:
    unstaged = staged_context(tmp_path / "unstaged", Clock(), num_stages=None)
    register(unstaged, "h")
    assert refusal(lambda: lease(unstaged, "d", 0)) == (422, Reason.STAGE)  # --stage 0 of no map
    assert refusal(lambda: announce(StageHolders(unstaged), "h", 1, [0], 9001)) == (422, Reason.STAGE)
    staged = staged_context(tmp_path / "staged", Clock(), num_stages=2)
    register(staged, "h")
    holders = StageHolders(staged)
    assert refusal(lambda: announce(holders, "h", 2, [0], 9001)) == (422, Reason.STAGE)  # stages 0-1
    announce(holders, "h", 1, [0], 9001)  # stage 1 is the map's last: accepted
    assert [row["worker_id"] for row in holders.listing()] == ["h"]


def test_only_the_route_learns_of_a_lease_and_only_its_driver_reports(tmp_path: Path) -> None:
    context = staged_context(tmp_path, Clock(), num_stages=2)
    holders = StageHolders(context, dial=listening)
    register(context, "on", "off", "driver", "other")
    announce(holders, "on", 1, [0, 1], 9001, rate=5.0)
    announce(holders, "off", 1, [0], 9002)
    found = lease(context, "driver", 1)
    assert route_of(found) == ["on"] and found is not None
    info = holders.lease_info("on", found.lease_id)
    with context.store.transaction() as db:
        driver_key = db.execute("SELECT public_key FROM worker_keys WHERE worker_id = 'driver'").fetchone()[0]
    assert (info.driver_id, info.driver_public_key, info.version, info.stages) == (
        "driver",
        driver_key,
        1,
        [1],
    )
    assert info.deadline_unix == found.deadline_unix
    for asker, lease_id in (("off", found.lease_id), ("driver", found.lease_id), ("on", "l-none")):
        assert refusal(lambda a=asker, i=lease_id: holders.lease_info(a, i)) == (404, Reason.UNKNOWN_LEASE)

    report = StageReport(lease_id=found.lease_id, stage=1, worker_id="on", reason="bad_answer", detail="d")
    assert refusal(lambda: holders.report("other", report)) == (404, Reason.UNKNOWN_LEASE)
    wrong_hop = report.model_copy(update={"worker_id": "off"})
    assert refusal(lambda: holders.report("driver", wrong_hop)) == (404, Reason.UNKNOWN_LEASE)
    with context.store.transaction() as db:
        assert (
            db.execute("SELECT state FROM leases WHERE lease_id = ?", (found.lease_id,)).fetchone()[0]
            == "open"
        )
        assert db.execute("SELECT COUNT(*) FROM events WHERE kind = 'stage_hop_failed'").fetchone()[0] == 0

    assert holders.report("driver", report) == {"expired": found.lease_id}
    with context.store.transaction() as db:
        assert (
            db.execute("SELECT state FROM leases WHERE lease_id = ?", (found.lease_id,)).fetchone()[0]
            == "expired"
        )
        held = db.execute("SELECT COUNT(*) FROM slots WHERE lease_id = ?", (found.lease_id,)).fetchone()[0]
        events = db.execute("SELECT worker_id, reason FROM events WHERE kind = 'stage_hop_failed'").fetchall()
    assert held == 0  # its slots are free for the next lease
    assert [tuple(row) for row in events] == [("on", f"bad_answer: stage 1 on lease {found.lease_id} (d)")]
    assert refusal(lambda: holders.lease_info("on", found.lease_id)) == (410, Reason.LEASE_EXPIRED)
    assert refusal(lambda: holders.report("driver", report)) == (404, Reason.UNKNOWN_LEASE)  # once only
