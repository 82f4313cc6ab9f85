"""The relay for stage holders behind NAT: the coordinator's courier (`coordinator/stage_relay.py`)
on a real store and event loop, and a real holder's checks of what the relay hands it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from test_coordinator_store import Clock
from test_stage_blame import Route, model  # noqa: F401 - `model` is a fixture
from test_stage_routing import lease, register, staged_context

from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.coordinator.stage_relay import MAX_QUEUED, Relay
from decentrl.coordinator.stage_routing import StageHolders, reachable
from decentrl.protocol import Lease
from decentrl.stage_wire import RelayedRequest, StageAnnounce, StepRequest, pack, relay_path

SIGNED = {"X-Decentrl-Timestamp": "1.000", "X-Decentrl-Nonce": "ab" * 16, "X-Decentrl-Signature": "cd" * 64}
PATH = relay_path("h1", "l1", "step")


async def never_cut() -> bool:
    return False


def run(coroutine):  # noqa: ANN001, ANN201 - any coroutine
    return asyncio.run(asyncio.wait_for(coroutine, 20))


def relay_of(tmp_path: Path) -> Relay:
    return Relay(staged_context(tmp_path, Clock(), num_stages=2))


async def exchange(relay: Relay, holder: str, status: int, body: bytes, answering_as: str | None = None):
    """A holder's exchange: take one request, answer it (as `answering_as`, if another holder)."""
    handed = await relay.next_request(holder, 5.0, never_cut)
    assert handed is not None
    relay.take_answer(answering_as or holder, handed.request_id, status, body)
    return handed


async def refusal(call) -> tuple[int, str]:  # noqa: ANN001 - an awaitable
    with pytest.raises(ApiError) as error:
        await call
    return error.value.status, error.value.reason


def test_a_request_reaches_its_holder_byte_for_byte_and_the_answer_its_driver(tmp_path: Path) -> None:
    relay = relay_of(tmp_path)

    async def scene():
        holder = asyncio.create_task(exchange(relay, "h1", 409, b"answer bytes"))
        await asyncio.sleep(0)  # its exchange is open: the holder is connected
        response = await relay.forward("h1", PATH, SIGNED, b"\x00step body\xff")
        return response, await holder

    response, handed = run(scene())
    # the holder's status and body, whatever they are (a 409 is the holder's to give)
    assert (response.status_code, response.body) == (409, b"answer bytes")
    assert (handed.path, handed.headers, handed.body) == (PATH, SIGNED, b"\x00step body\xff")
    assert relay.stats()["relayed_requests"] == 1 and relay.waiting == {}


def test_only_the_holder_handed_a_request_can_answer_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("decentrl.coordinator.stage_relay.ANSWER_SECONDS", 0.5)
    relay = relay_of(tmp_path)

    async def scene():
        holder = asyncio.create_task(exchange(relay, "h1", 200, b"forged", answering_as="h2"))
        await asyncio.sleep(0)
        status = await refusal(relay.forward("h1", PATH, SIGNED, b"body"))
        await holder
        return status

    assert run(scene()) == (504, Reason.NOT_READY)  # h2's answer was ignored; nobody else answered


def test_a_holder_with_no_exchange_open_or_a_full_queue_is_refused_at_once(tmp_path: Path) -> None:
    relay = relay_of(tmp_path)

    async def scene():
        gone = await refusal(relay.forward("h1", PATH, SIGNED, b"body"))
        waiting = asyncio.create_task(relay.next_request("h1", 0.05, never_cut))
        await waiting  # it came and went: connected for a while, its queue fills
        pending = [asyncio.create_task(relay.forward("h1", PATH, SIGNED, b"b")) for _ in range(MAX_QUEUED)]
        await asyncio.sleep(0)
        full = await refusal(relay.forward("h1", PATH, SIGNED, b"one more"))
        for task in pending:
            task.cancel()
        return gone, full

    gone, full = run(scene())
    assert gone == (503, Reason.NOT_READY) and full == (503, Reason.NOT_READY)


def test_a_holder_that_hangs_up_fails_what_it_was_handed_at_once(tmp_path: Path) -> None:
    """Its process died: the exchange it kept open is cut, and the driver waiting on the step it
    was handed hears 503 in well under a second, not at the 30 s answer timeout."""
    relay = relay_of(tmp_path)
    hung_up = asyncio.Event

    async def scene():
        cut = hung_up()

        async def disconnected() -> bool:
            return cut.is_set()

        taken = asyncio.create_task(relay.next_request("h1", 5.0, never_cut))  # its first link
        await asyncio.sleep(0)
        driver = asyncio.create_task(relay.forward("h1", PATH, SIGNED, b"step"))
        assert await taken is not None  # handed over; the holder starts computing, and dies
        second = asyncio.create_task(relay.next_request("h1", 5.0, disconnected))  # its other link
        await asyncio.sleep(0.05)
        started = time.monotonic()
        cut.set()
        assert await second is None
        response = await driver
        return response, time.monotonic() - started

    response, seconds = run(scene())
    assert response.status_code == 503 and b"dropped" in response.body and seconds < 1.0
    assert not relay.connected("h1")  # until it opens an exchange again


def test_a_driver_may_relay_only_through_the_holders_of_its_own_open_leases(tmp_path: Path) -> None:
    context = staged_context(tmp_path, Clock(), num_stages=2)
    relay, holders = Relay(context), StageHolders(context, dial=lambda url: True)
    register(context, "h1", "d1", "d2")
    holders.announce("h1", StageAnnounce(stage=1, url=None, version=3, held_versions=[3]))
    granted: Lease | None = lease(context, "d1", 3)
    assert granted is not None and granted.route and granted.route[0].relayed and granted.route[0].url is None
    relay.check_route("d1", "h1", granted.lease_id)  # its own lease, through h1
    for driver, holder, lease_id in (
        ("d2", "h1", granted.lease_id),
        ("d1", "h2", granted.lease_id),
        ("d1", "h1", "l-x"),
    ):
        with pytest.raises(ApiError) as error:
            relay.check_route(driver, holder, lease_id)
        assert (error.value.status, error.value.reason) == (404, Reason.UNKNOWN_LEASE)


def test_an_address_the_coordinator_cannot_connect_to_is_relayed(tmp_path: Path) -> None:
    context = staged_context(tmp_path, Clock(), num_stages=2)
    holders = StageHolders(context)
    register(context, "h1", "h2")
    closed = "http://127.0.0.1:9"  # discard: nothing listens on loopback here
    assert not reachable(closed)
    answer = holders.announce("h1", StageAnnounce(stage=1, url=closed, version=3, held_versions=[3]))
    assert answer.relayed
    assert holders.announce("h2", StageAnnounce(stage=1, url=None, version=3, held_versions=[3])).relayed


def test_a_holder_refuses_a_relayed_request_signed_for_another_holder_or_lease(model, tmp_path: Path) -> None:  # noqa: F811
    route = Route(model, tmp_path, "bfloat16", {})
    try:
        holder, driver = route.servers[0], route.driver
        request = StepRequest(
            lease_id="l-1",
            session="s" * 8,
            step=0,
            version=0,
            codec="bfloat16",
            shape=[1, 1, 64],
            prompt_lengths=[1],
        )
        body = pack(request, bytes(128))
        for signed_for in (relay_path("s2", "l-1", "step"), relay_path("s1", "l-2", "step")):
            headers = driver.http.auth.headers("POST", signed_for, body)  # a valid signature, for elsewhere
            status, detail = holder.handle_relayed(RelayedRequest("r", signed_for, headers, body))
            assert status == 403 and b"signed for" in detail, detail
        own = relay_path("s1", "l-1", "step")
        headers = driver.http.auth.headers("POST", own, body)
        status, answer = holder.handle_relayed(RelayedRequest("r", own, headers, body))
        assert status == 200, answer
        # the same request, replayed through the relay: its nonce is spent
        assert holder.handle_relayed(RelayedRequest("r2", own, headers, body))[0] == 401
    finally:
        route.close()
