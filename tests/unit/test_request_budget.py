"""The request budget (coordinator/http/budget.py) as ASGI middleware around a handler that holds
its request until released, as a slow request body does: shares per token and per address, and the
per-address allowance of failed authentications."""

from __future__ import annotations

import asyncio
import hashlib

from decentrl.config import ServiceConfig
from decentrl.coordinator.http.budget import TARPIT_HEADER, KnownTokens, RequestBudget

CONFIG = ServiceConfig(max_requests_in_flight=64, reserved_requests=8, max_requests_per_token=4)


class Held:
    """An ASGI app whose requests stay in flight until `release` (a body still trickling in)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.entered = 0

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        self.entered += 1
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def scope(token: str | None, address: str) -> dict:
    headers = [] if token is None else [(b"authorization", f"Bearer {token}".encode())]
    return {"type": "http", "path": "/v1/rollouts", "headers": headers, "client": (address, 40000)}


async def status(app: RequestBudget, token: str | None, address: str) -> int:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope(token, address), receive, send)
    return sent[0]["status"]


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def test_one_token_holds_at_most_its_share_whatever_its_addresses() -> None:
    async def run() -> tuple[list[int], int, int]:
        held, known = Held(), KnownTokens()
        known.add(sha("hostile"))
        known.add(sha("honest"))
        app = RequestBudget(held, CONFIG, known)
        # 40 slow requests with one worker's token spread over 6 addresses (each under its own share)
        hostile = [asyncio.create_task(status(app, "hostile", f"127.0.0.{2 + i % 6}")) for i in range(40)]
        await asyncio.sleep(0.05)
        entered = held.entered
        honest = asyncio.create_task(status(app, "honest", "127.0.0.1"))
        await asyncio.sleep(0.05)
        held.release.set()
        return await asyncio.gather(*hostile), entered, await honest

    hostile, entered, honest = asyncio.run(run())
    assert entered == CONFIG.max_requests_per_token
    assert sorted(hostile).count(503) == 40 - CONFIG.max_requests_per_token
    assert honest == 200


def test_one_address_holds_at_most_its_share_whatever_its_tokens() -> None:
    config = CONFIG.model_copy(update={"max_requests_per_address": 6})

    async def run() -> tuple[list[int], int]:
        held = Held()
        app = RequestBudget(held, config, KnownTokens())
        junk = [asyncio.create_task(status(app, f"made-up-{i}", "127.0.0.9")) for i in range(20)]
        await asyncio.sleep(0.05)
        elsewhere = asyncio.create_task(status(app, "another", "127.0.0.1"))
        await asyncio.sleep(0.05)
        held.release.set()
        return await asyncio.gather(*junk), await elsewhere

    junk, elsewhere = asyncio.run(run())
    assert junk.count(200) == 6 and junk.count(503) == 14
    assert elsewhere == 200


def test_the_trainer_token_is_not_held_to_a_share() -> None:
    async def run() -> list[int]:
        held, known = Held(), KnownTokens()
        known.trust(sha("trainer"))
        app = RequestBudget(held, CONFIG, known)
        calls = [asyncio.create_task(status(app, "trainer", "127.0.0.1")) for _ in range(12)]
        await asyncio.sleep(0.05)
        held.release.set()
        return await asyncio.gather(*calls)

    assert asyncio.run(run()) == [200] * 12


def test_an_address_past_its_failed_authentications_is_refused_before_the_handler() -> None:
    async def run() -> tuple[int, int, int, int]:
        held, known = Held(), KnownTokens(failed_auths_per_minute=5)
        known.tarpit_seconds = 0.0
        held.release.set()
        known.add(sha("known"))
        app = RequestBudget(held, CONFIG, known)
        for _ in range(int(known.failed_auths.burst)):  # the address's allowance, spent
            known.auth_failed("127.0.0.7")
        before = held.entered
        refused = await status(app, "made-up", "127.0.0.7")
        entered = held.entered - before
        # a token that already authenticated still passes from there; other addresses are untouched
        return refused, entered, await status(app, "known", "127.0.0.7"), await status(app, "x", "127.0.0.8")

    refused, entered, known_token, other_address = asyncio.run(run())
    assert (refused, entered) == (429, 0)
    assert known_token == 200 and other_address == 200


def test_workers_sharing_an_address_are_held_to_their_own_shares_only() -> None:
    """Twenty authenticated workers on one machine (one address), two requests in flight each."""
    config = CONFIG.model_copy(update={"max_requests_per_address": 6})

    async def run() -> list[int]:
        held, known = Held(), KnownTokens()
        for index in range(20):
            known.add(sha(f"worker-{index}"))
        app = RequestBudget(held, config, known)
        calls = [asyncio.create_task(status(app, f"worker-{i % 20}", "127.0.0.1")) for i in range(40)]
        await asyncio.sleep(0.05)
        held.release.set()
        return await asyncio.gather(*calls)

    assert asyncio.run(run()) == [200] * 40


class Marked:
    """An ASGI app that answers at once: a 429 marked for the tarpit, or a plain 200 (`path`)."""

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        tarpit = scope["path"] == "/v1/leases"
        headers = [(b"retry-after", b"1")] + ([(TARPIT_HEADER.encode(), b"1")] if tarpit else [])
        await send({"type": "http.response.start", "status": 429 if tarpit else 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"{}"})


def test_a_marked_answer_is_sent_late_without_the_mark_and_holds_no_share_while_it_waits() -> None:
    """A victim's token carried by an observer's refused requests (replays from an address out of
    allowance) keeps its share: the refusals wait after their handler, outside the budget."""

    async def call(app: RequestBudget, path: str) -> tuple[dict, float]:
        sent: list[dict] = []
        started = asyncio.get_running_loop().time()

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        request = {**scope("victim", "127.0.0.5"), "path": path}
        await app(request, receive, send)
        return sent[0], asyncio.get_running_loop().time() - started

    async def run() -> tuple[list, tuple[dict, float], int, int]:
        known = KnownTokens()
        known.add(sha("victim"))
        known.tarpit_seconds = 0.3
        app = RequestBudget(Marked(), CONFIG, known)
        # more marked requests than the token's share, all waiting at once
        marked = [
            asyncio.create_task(call(app, "/v1/leases")) for _ in range(3 * CONFIG.max_requests_per_token)
        ]
        await asyncio.sleep(0.05)
        holding, in_flight = known.holding[f"token:{sha('victim')}"], known.in_flight
        plain = await call(app, "/v1/rollouts")  # the token's own request, meanwhile
        return await asyncio.gather(*marked), plain, holding, in_flight

    marked, (plain, plain_seconds), holding, in_flight = asyncio.run(run())
    assert (holding, in_flight) == (0, 0)  # the waiting refusals hold nothing
    assert plain["status"] == 200 and plain_seconds < 0.2
    for start, seconds in marked:
        assert start["status"] == 429 and seconds >= 0.3
        assert [name for name, _ in start["headers"]] == [b"retry-after"]  # the mark is not sent
