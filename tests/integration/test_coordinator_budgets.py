"""What one client may cost the coordinator before it is refused: submission bytes bounded by the
slots it holds, leases bounded by what it delivered, and a client that leaves mid-request
counted in `/metrics`, never a traceback. Through the real app (FastAPI's TestClient, SQLite)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from pathlib import Path

import pytest
from integration.test_coordinator_api import Harness, model_dir  # noqa: F401 - the fixture

pytestmark = pytest.mark.integration


@pytest.fixture
def harness(tmp_path: Path, model_dir: Path):  # noqa: F811
    harness = Harness(tmp_path / "run", model_dir, max_body_bytes=4_000_000, max_pending_groups=40)
    harness.publish(0)
    yield harness
    harness.stop()


def test_a_submission_larger_than_the_slots_held_is_refused_before_parsing(harness: Harness) -> None:
    """4,001 copies of a rollout from a worker holding two slots: 413 for the bytes, not a 409
    after parsing them all; a submission of what it holds is accepted."""
    worker = harness.register()
    lease = harness.lease(worker)
    rollouts = [harness.rollout(lease, slot=slot) for slot in range(2)]
    body = json.dumps({"rollouts": [rollouts[0]] * 4001})
    headers = worker | {"Content-Type": "application/json"}
    answer = harness.client.post("/v1/rollouts", content=body, headers=headers)
    assert answer.status_code == 413, answer.text
    assert "rollouts" in harness.rejections()[-1] or harness.rejections()[-1] == "oversized"
    assert harness.submit(worker, *rollouts).status_code == 200


def test_a_fresh_identity_leases_its_quota_and_earns_more_by_delivering(harness: Harness) -> None:
    """Four newcomers asking for 64 groups each and never answering get `trust.lease_groups_new`
    groups each, and leave room under `max_pending_groups` (40 here) for a fifth; once it has
    delivered, its cap grows by a group per group's worth accepted."""
    quota = harness.config.trust.lease_groups_new
    hoarders = [harness.register(f"hoarder{i}") for i in range(4)]
    held = [len(harness.lease(hoarder, max_groups=64)["tasks"]) for hoarder in hoarders]
    assert held == [quota] * 4, held
    worker = harness.register("honest")
    lease = harness.lease(worker, max_groups=64)
    first = len(lease["tasks"])  # a share of 40 split between five holders and one more
    assert first == math.ceil(40 / 6), first
    rollouts = [
        harness.rollout(lease, task=t, slot=s, correct=s == 0) for t in range(first) for s in range(2)
    ]
    assert harness.submit(worker, *rollouts).status_code == 200
    harness.clock.now += harness.config.coordinator.lease_seconds + 1  # the hoarders' leases expire
    assert len(harness.lease(worker, max_groups=64)["tasks"]) == quota + first


def test_a_client_that_leaves_mid_body_is_counted_not_traced(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """A signed submission whose client disconnects before its body arrives: no traceback in the
    log, and `decentrl_client_disconnects_total` counts it."""
    worker = harness.register()
    app = harness.client.app
    messages = iter([{"type": "http.request", "body": b"{", "more_body": True}, {"type": "http.disconnect"}])
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/rollouts",
        "raw_path": b"/v1/rollouts",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"authorization", worker["Authorization"].encode()), (b"content-length", b"100")],
        "client": ("127.0.0.5", 5000),
        "server": ("testserver", 80),
        "state": {},
    }
    sent: list[dict] = []

    async def receive() -> dict:
        return next(messages)

    async def send(message: dict) -> None:
        sent.append(message)

    signer = harness.signers.signers[worker["Authorization"].removeprefix("Bearer ")]
    scope["headers"] += [
        (name.lower().encode(), value.encode())
        for name, value in signer.headers("POST", "/v1/rollouts", b"{}", harness.clock()).items()
    ]
    with caplog.at_level(logging.INFO):
        asyncio.run(app(scope, receive, send))
    assert not [record for record in caplog.records if record.exc_info], caplog.text
    metrics = harness.client.get("/metrics").text
    assert "decentrl_client_disconnects_total 1" in metrics, metrics
