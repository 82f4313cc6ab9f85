"""Clients that attack the service itself, and the honest worker whose rate they must not take
(`tests/adversarial/` and `decentrl bench adversarial` share them).

Every hostile client here is a plain socket or a real signed client on loopback; each loop is
bounded by a count or a deadline. Several source addresses come from 127.0.0.0/8 (every one of
them reaches a server bound to 127.0.0.1), so per-address caps can be exercised from one machine.
"""

from __future__ import annotations

import multiprocessing
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from benchmarks.adversarial.arena import Agent, Arena
from benchmarks.adversarial.senders import address, attacker, send_captured, send_signed
from decentrl.client import RequestRejected
from decentrl.protocol import API_PREFIX, LeaseRequest, RolloutSubmission
from decentrl.trust.identity import Signer

HONEST_LEASE_GROUPS = 4
"""Groups per lease of the bench's honest worker (`service_figures`, `flood_figures`). Its own
request allowance (`trust.requests_per_second`, 20 by default) allows at most 10 lease-and-submit
rounds a second: with leases of one group of 8 that capped it at 80 rollouts/s, about what the
loop does unthrottled on loopback, so the limit, not the attack, would be what a figure measured.
With four groups the cap is four times that; `honest_throttled` counts the 429s it still got."""


def honest_rate(agent: Agent, seconds: float, groups: int | None = None) -> float:
    """Rollouts accepted per second for an honest worker that leases, plays and submits in a loop
    (leases of `groups`, default `agent.lease_groups`)."""
    groups = agent.lease_groups if groups is None else groups
    accepted, started = 0, time.monotonic()
    while time.monotonic() - started < seconds:
        lease = agent.lease(groups)
        result = agent.client.submit_rollouts(RolloutSubmission(rollouts=agent.play(lease)))
        accepted += len(result.accepted)
    return accepted / (time.monotonic() - started)


class Sockets:
    """Hostile connections to `url`: idle ones, and ones that trickle a request head byte by byte."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.target = (parts.hostname, parts.port)
        self.sockets: list[socket.socket] = []
        self.refused = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def open(self, count: int, addresses: int) -> None:
        """`count` idle connections spread over `addresses` source addresses."""
        for index in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.settimeout(2.0)
            try:
                sock.bind((address(index % addresses), 0))
                sock.connect(self.target)
            except OSError:
                self.refused += 1
                sock.close()
                continue
            self.sockets.append(sock)

    def trickle(self, count: int, interval: float = 0.5) -> None:
        """`count` more connections that send a request head one byte every `interval` seconds."""
        head = b"POST /v1/leases HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n" + b"X-Pad: a\r\n" * 1000
        start = len(self.sockets)
        self.open(count, addresses=8)

        def drip() -> None:
            for offset in range(len(head)):
                for sock in self.sockets[start:]:
                    with suppress(OSError):  # the server closed it: that is the point
                        sock.send(head[offset : offset + 1])
                if self._stop.wait(interval):
                    return

        thread = threading.Thread(target=drip, daemon=True)
        thread.start()
        self._threads.append(thread)

    def closed_by_server(self) -> float:
        """Fraction of the hostile connections the server has closed."""
        closed = 0
        for sock in self.sockets:
            sock.setblocking(False)
            try:
                closed += sock.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:  # reset by the server
                closed += 1
        return closed / max(1, len(self.sockets))

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        for sock in self.sockets:
            sock.close()
        self.sockets.clear()


@contextmanager
def hostile_sockets(url: str) -> Iterator[Sockets]:
    sockets = Sockets(url)
    try:
        yield sockets
    finally:
        sockets.close()


def status_of(call) -> int:  # noqa: ANN001 - any client call
    try:
        call()
        return 200
    except RequestRejected as exc:
        return exc.status


@dataclass
class ServiceFigure:
    honest_rate: float
    """Rollouts per second the honest worker got accepted while the attack ran."""
    baseline: float
    """The honest worker's rate measured right before, without the attack (the machine's load moves)."""
    ratio: float
    """`honest_rate` over `baseline`."""
    attacker_cost: float
    """What the attacker spent per second: connections held, or requests sent."""
    cost_unit: str
    cost_per_damage: float | None
    """`attacker_cost` per honest rollout/s lost (None: nothing was lost)."""


def figure(baseline: float, rate: float, cost: float, unit: str) -> dict:
    lost = baseline - rate
    per_damage = cost / lost if lost > 0 else None
    return asdict(ServiceFigure(rate, baseline, rate / max(baseline, 1e-9), cost, unit, per_damage))


def timed_flood(
    agent: Agent, seconds: float, make: Callable, args: tuple, threads: int, unit: str = "requests/s"
) -> dict:
    """The honest rate just before and while `threads` loops of the sender `make(*args, thread)`
    run in a process of their own (`senders.attacker`), with the requests it sent per second as
    its cost and the CPU seconds it spent."""
    baseline = honest_rate(agent, seconds)
    spawn = multiprocessing.get_context("spawn")
    ready, stop, out = spawn.Event(), spawn.Event(), spawn.Queue()
    process = spawn.Process(target=attacker, args=(make, args, threads, ready, stop, out), daemon=True)
    process.start()
    deadline = time.monotonic() + 120
    while not ready.wait(0.5):  # a child that died on start (an import error) fails here, not at a timeout
        assert process.is_alive(), f"the attacker's process exited with {process.exitcode} before starting"
        assert time.monotonic() < deadline, "the attacker's process did not start in 120 s"
    time.sleep(1.0)  # its flood is under way
    started = time.monotonic()
    rate = honest_rate(agent, seconds)
    elapsed = time.monotonic() - started
    stop.set()
    statuses, sent, cpu = out.get(timeout=60)
    process.join(timeout=30)
    result = figure(baseline, rate, sent / (elapsed + 1.0), unit)
    result |= {"statuses": statuses, "attacker_cpu_seconds": round(cpu, 2)}
    return result


def service_figures(arena: Arena, seconds: float = 5.0) -> dict:
    """The honest worker's rate right before and under each service-level attack, with what the
    attack cost; and whether a third party could frame a key holder (strikes, should be 0)."""
    honest = arena.agent("service-honest")
    honest.lease_groups = HONEST_LEASE_GROUPS
    honest_rate(honest, 1.0)  # warm up
    figures: dict = {"seconds_per_measurement": seconds}
    for name, count, trickle in (("idle_connections", 1100, False), ("slow_headers", 200, True)):
        baseline = honest_rate(honest, seconds)
        with hostile_sockets(arena.url) as sockets:
            sockets.trickle(count) if trickle else sockets.open(count, addresses=40)
            figures[name] = figure(
                baseline, honest_rate(honest, seconds), len(sockets.sockets), "connections"
            )
    # Each attacker runs in a process of its own, as the floods do: sent from the bench's own
    # threads, its requests took the GIL from the honest worker's loop, which samples in the same
    # process, and that loss was counted as the coordinator's.
    hoarder = arena.agent("service-hoarder")
    hoard = LeaseRequest(policy_version=arena.latest, max_groups=256).model_dump_json().encode()
    args = (arena.url, f"{API_PREFIX}/leases", [identity(hoarder)], hoard, 0.1, 310)
    figures["lease_hoarding"] = timed_flood(honest, seconds, send_signed, args, 2, "lease requests/s")
    hoarder.close()
    # An observer holding the honest worker's token and a captured request: replays and junk
    # signatures from its own address, as fast as two threads send them.
    path = f"{API_PREFIX}/leases"
    body = LeaseRequest(policy_version=arena.latest, max_groups=1).model_dump_json().encode()
    captured = {"Authorization": f"Bearer {honest.client.token}", "Content-Type": "application/json"}
    captured |= honest.signer.headers("POST", path, body)
    junk = {**captured, **Signer(Ed25519PrivateKey.generate()).headers("POST", path, body)}
    args = (arena.url, path, body, [captured, junk], 300)
    figures["replays_and_junk_signatures"] = timed_flood(honest, seconds, send_captured, args, 2)
    figures["replays_and_junk_signatures"]["strikes"] = _strikes(arena, honest.worker_id)
    figures["work_before_binding"] = _unbound_flood(arena, honest, seconds)
    figures["framing_strikes"] = _framing_strikes(arena)
    figures["honest_throttled"] = honest.client.retry_reasons["HTTP 429"]
    honest.close()
    return figures


def identity(agent: Agent) -> tuple[str, bytes]:
    """The agent's token and private key, for a sender in another process (`senders.send_signed`)."""
    assert agent.client.token is not None, "a registered agent"
    return agent.client.token, agent.signer.key.private_bytes_raw()


def _strikes(arena: Arena, worker_id: str) -> int:
    query = "SELECT COUNT(*) FROM events WHERE kind = 'violation' AND worker_id = ?"
    return arena.query(query, worker_id)[0][0]


def _unbound_flood(arena: Arena, honest: Agent, seconds: float) -> dict:
    """A registered worker re-sends one accepted submission as fast as it may (each a 409 for a
    filled slot, refused before any replay or scoring, no strike) while the honest worker works."""
    flooder = arena.agent("service-unbound")
    submission = RolloutSubmission(rollouts=flooder.play(flooder.lease(1)))
    flooder.client.submit_rollouts(submission)
    body = submission.model_dump_json().encode()  # its 429s are part of what it pays: no retry
    args = (arena.url, f"{API_PREFIX}/rollouts", [identity(flooder)], body, 0.0, 320)
    result = timed_flood(honest, seconds, send_signed, args, 2)
    result["strikes"] = _strikes(arena, flooder.worker_id)
    flooder.close()
    return result


def _framing_strikes(arena: Arena) -> int:
    """Strikes charged to a key holder after 20 replays of its captured request and 20 junk
    signatures with its token (should be 0)."""
    victim = arena.agent("service-victim")
    body = LeaseRequest(policy_version=arena.latest, max_groups=1).model_dump_json().encode()
    path = f"{API_PREFIX}/leases"
    captured = {"Authorization": f"Bearer {victim.client.token}", "Content-Type": "application/json"}
    captured |= victim.signer.headers("POST", path, body)
    junk = {**captured, **Signer(Ed25519PrivateKey.generate()).headers("POST", path, body)}
    for headers in [captured] * 21 + [junk] * 20:
        httpx.post(arena.url + path, content=body, headers=headers)
    strikes = _strikes(arena, victim.worker_id)
    victim.close()
    return strikes
