"""Senders of the floods in `floods.py`, run in a process of their own (a real attacker's CPU is
not the honest worker's): this module imports no model code, so the process starts in a second.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import suppress

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from decentrl.protocol import API_PREFIX
from decentrl.trust.identity import Signer


def address(index: int) -> str:
    """The index-th hostile source address (127.0.0.2, 127.0.0.3, ...); 127.0.0.1 stays honest."""
    return f"127.0.{index // 250}.{2 + index % 250}"


def send_oversized(url: str, token: str, key: bytes, body: bytes, index: int) -> Callable[[], int]:
    signer = Signer(Ed25519PrivateKey.from_private_bytes(key))
    path = f"{API_PREFIX}/rollouts"
    client = httpx.Client(transport=httpx.HTTPTransport(local_address=address(500 + index)), timeout=30)

    def send() -> int:
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        headers |= signer.headers("POST", path, body)
        return client.post(url + path, content=body, headers=headers).status_code

    return send


def send_made_up_tokens(url: str, addresses: int, index: int) -> Callable[[], int]:
    clients = [
        httpx.Client(transport=httpx.HTTPTransport(local_address=address(400 + n)), timeout=10)
        for n in range(index, addresses, 8)
    ]
    turn = iter(range(1 << 62))

    def send() -> int:
        count = next(turn)
        headers = {"Authorization": f"Bearer made-up-{index}-{count}"}
        answer = clients[count % len(clients)].post(f"{url}{API_PREFIX}/leases", json={}, headers=headers)
        return answer.status_code

    return send


def send_signed(
    url: str,
    path: str,
    identities: list[tuple[str, bytes]],
    body: bytes,
    pause: float,
    source: int,
    index: int,
) -> Callable[[], int]:
    """Key holders' own requests: `body` POSTed to `path` by identity `index` of `identities`
    (token, private key) in turn, signed afresh each time (a new nonce: nothing a replay guard
    refuses), `pause` seconds after each answer, from address `source + index`."""
    token, key = identities[index % len(identities)]
    signer = Signer(Ed25519PrivateKey.from_private_bytes(key))
    client = httpx.Client(transport=httpx.HTTPTransport(local_address=address(source + index)), timeout=30)

    def send() -> int:
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        headers |= signer.headers("POST", path, body)
        status = client.post(url + path, content=body, headers=headers).status_code
        time.sleep(pause)
        return status

    return send


def send_captured(
    url: str, path: str, body: bytes, captured: list[dict], source: int, index: int
) -> Callable[[], int]:
    """An observer's copies of captured requests (`captured`: their headers, taken in turn), all
    from one address of its own."""
    client = httpx.Client(transport=httpx.HTTPTransport(local_address=address(source)), timeout=10)
    turn = iter(range(1 << 62))

    def send() -> int:
        headers = captured[(next(turn) + index) % len(captured)]
        return client.post(url + path, content=body, headers=headers).status_code

    return send


def attacker(make: Callable[..., Callable[[], int]], args: tuple, threads: int, ready, stop, out) -> None:  # noqa: ANN001
    """A separate process (as a real attacker is: its CPU is not the honest worker's) running
    `threads` loops of the sender `make(*args, thread)` builds, until `stop`; puts its statuses,
    request count and CPU seconds on `out`."""
    statuses: set[int] = set()
    sent = [0]

    def loop(send: Callable[[], int]) -> None:
        while not stop.is_set():
            with suppress(Exception):  # refused, reset or closed mid-body: the next one goes out
                statuses.add(send())
            sent[0] += 1

    senders = [make(*args, index) for index in range(threads)]  # clients take a while to build
    ready.set()
    cpu = time.process_time()
    workers = [threading.Thread(target=loop, args=(send,), daemon=True) for send in senders]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    out.put((sorted(statuses), sent[0], time.process_time() - cpu))
