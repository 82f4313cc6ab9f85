"""Attacks that spend the coordinator's shared budgets (request slots, room for open groups, parsing
time, failed authentications) from several loopback addresses, each measured as the honest
worker's rate before and while it runs (`tests/adversarial/test_service.py` and `decentrl bench
adversarial` share them). Every loop is bounded by a deadline or a stop event.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from contextlib import suppress
from urllib.parse import urlsplit

import httpx

from benchmarks.adversarial.arena import Agent, Arena
from benchmarks.adversarial.outsiders import (
    HONEST_LEASE_GROUPS,
    address,
    figure,
    honest_rate,
    identity,
    timed_flood,
)
from benchmarks.adversarial.senders import send_made_up_tokens, send_oversized, send_signed
from decentrl.protocol import API_PREFIX, LeaseRequest

SLOW_BODY_BYTES = 100_000


def slow_bodies(arena: Arena, honest: Agent, seconds: float, count: int = 300, addresses: int = 10) -> dict:
    """`count` signed submissions with one worker's token, spread over `addresses` source addresses,
    whose bodies trickle in a byte a second: each would hold a request slot until the body deadline."""
    hostile = arena.agent("slow-bodies")
    hostile.lease(1)  # an authenticated token: the budget's reserved slots are open to it too
    parts = urlsplit(arena.url)
    path = f"{API_PREFIX}/rollouts"
    signed = hostile.signer.headers("POST", path, b"{}")  # reaching the body read is all it takes
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {SLOW_BODY_BYTES}\r\nAuthorization: Bearer {hostile.client.token}\r\n"
        + "".join(f"{name}: {value}\r\n" for name, value in signed.items())
        + "\r\n"
    ).encode()
    baseline = honest_rate(honest, seconds)
    stop, sockets = threading.Event(), []
    for index in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(2.0)
        with suppress(OSError):
            sock.bind((address(index % addresses), 0))
            sock.connect((parts.hostname, parts.port))
            sock.sendall(head + b"[")
            sockets.append(sock)

    def drip() -> None:
        while not stop.wait(1.0):
            for sock in sockets:
                with suppress(OSError):  # refused and closed by the server: that is the defence
                    sock.send(b" ")

    thread = threading.Thread(target=drip, daemon=True)
    thread.start()
    try:
        rate = honest_rate(honest, seconds)
    finally:
        stop.set()
        thread.join(timeout=5)
        for sock in sockets:
            sock.close()  # mid-body: the server counts these disconnects, logs no traceback
        hostile.close()
    return figure(baseline, rate, len(sockets), "slow requests")


def fresh_hoarders(arena: Arena, honest: Agent, seconds: float, identities: int = 4) -> dict:
    """`identities` newly registered workers each ask for 256 groups every 100 ms and never answer."""
    hoarders = [arena.agent(f"fresh-hoarder-{index}") for index in range(identities)]
    body = LeaseRequest(policy_version=arena.latest, max_groups=256).model_dump_json().encode()
    # from a process of their own (their leases are granted before the honest worker measures)
    args = (arena.url, f"{API_PREFIX}/leases", [identity(hoarder) for hoarder in hoarders], body, 0.1, 330)
    result = timed_flood(honest, seconds, send_signed, args, identities, "lease requests/s")
    result["groups_held"] = arena.query(
        "SELECT COUNT(DISTINCT ls.task_id) FROM leases l JOIN lease_slots ls ON ls.lease_id = l.lease_id"
        f" WHERE l.state = 'open' AND l.worker_id IN ({','.join('?' * identities)})",
        *[hoarder.worker_id for hoarder in hoarders],
    )[0][0]
    for hoarder in hoarders:
        hoarder.close()
    return result


def oversized_submissions(arena: Arena, honest: Agent, seconds: float, copies: int = 4001) -> dict:
    """A worker holding one lease sends submissions of `copies` copies of its rollouts (each a 4xx)
    from its own process, as fast as two threads can; its CPU seconds are reported beside its damage."""
    flooder = arena.agent("oversized")
    rollouts = flooder.play(flooder.lease(1))
    one = [json.loads(rollout.model_dump_json()) for rollout in rollouts]
    body = json.dumps({"rollouts": (one * copies)[:copies]}).encode()
    key = flooder.signer.key.private_bytes_raw()
    result = timed_flood(honest, seconds, send_oversized, (arena.url, flooder.client.token, key, body), 2)
    result["body_bytes"] = len(body)
    flooder.close()
    return result


def failed_auth_flood(arena: Arena, honest: Agent, seconds: float, addresses: int = 50) -> dict:
    """Made-up worker tokens from `addresses` source addresses, from another process, as fast as
    eight threads send them."""
    return timed_flood(honest, seconds, send_made_up_tokens, (arena.url, addresses), 8)


def disconnects_counted(arena: Arena) -> int:
    """`decentrl_client_disconnects_total` in the coordinator's `/metrics` (cached for 5 s there)."""
    time.sleep(5.5)
    text = httpx.get(f"{arena.url}/metrics", timeout=10).text
    found = re.search(r"^decentrl_client_disconnects_total (\d+)", text, re.MULTILINE)
    return int(found[1]) if found else 0


def flood_figures(arena: Arena, seconds: float) -> dict:
    """The honest worker's rate right before and under each of these attacks; the client
    disconnects the coordinator counted, and whether its log holds a traceback of one."""
    honest = arena.agent("flood-honest")
    honest.lease_groups = HONEST_LEASE_GROUPS
    honest_rate(honest, 1.0)  # warm up
    figures = {
        "slow_bodies_one_token": slow_bodies(arena, honest, seconds),
        "fresh_hoarders": fresh_hoarders(arena, honest, seconds),
        "oversized_submissions": oversized_submissions(arena, honest, seconds),
        "failed_auth_flood": failed_auth_flood(arena, honest, seconds),
        "client_disconnects_counted": disconnects_counted(arena),
        "disconnect_tracebacks": arena.coordinator.log_path.read_text().count("ClientDisconnect"),
        "honest_throttled": honest.client.retry_reasons["HTTP 429"],
    }
    honest.close()
    return figures
