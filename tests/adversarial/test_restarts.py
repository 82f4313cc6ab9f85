"""Restarts and clocks: a wrong clock is a fixable 401, never a strike, and what the coordinator
remembers about signed requests (nonces, rate buckets) survives its restart.

One real coordinator process on loopback, stopped and started again on the same run directory.
No version is published, so an admitted `POST /v1/leases` answers 503 ("no policy version yet")
from the route: 503 means the request passed authentication, 401 that it did not.
"""

from __future__ import annotations

import time

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from adversarial.processes import Coordinator, register
from decentrl.client import CoordinatorClient
from decentrl.protocol import API_PREFIX, LeaseRequest
from decentrl.trust.identity import Signer

pytestmark = pytest.mark.integration

BURST = 10
LIMITED = ["trust.requests_per_second=0.01", f"trust.request_burst={BURST}"]
PATH = f"{API_PREFIX}/leases"
BODY = LeaseRequest(policy_version=0, max_groups=1).model_dump_json().encode()


def send(coordinator: Coordinator, headers: dict[str, str]) -> int:
    return httpx.post(coordinator.url + PATH, content=BODY, headers=headers, timeout=10).status_code


def signed(client: CoordinatorClient, skew: float = 0.0) -> dict[str, str]:
    headers = client.signer.headers("POST", PATH, BODY, now=time.time() + skew)
    return {"Authorization": f"Bearer {client.token}", "Content-Type": "application/json", **headers}


def test_wrong_clocks_get_the_server_time_and_no_strike(start_coordinator) -> None:  # noqa: ANN001
    coordinator = start_coordinator([])
    client, worker_id = register(coordinator)
    for skew in (-5.0, 61.0, -61.0, 3600.0):
        statuses = [send(coordinator, signed(client, skew)) for _ in range(6)]
        expected = 503 if abs(skew) < 60 else 401
        assert statuses == [expected] * 6, (skew, statuses)
    answer = httpx.post(coordinator.url + PATH, content=BODY, headers=signed(client, 90.0))
    assert answer.status_code == 401 and "server clock" in answer.json()["detail"]
    assert abs(float(answer.headers["X-Decentrl-Server-Time"]) - time.time()) < 5
    assert coordinator.violations(worker_id) == 0
    # The client adopts the server's clock from the 401 and signs again.
    client.signer.offset = 120.0
    assert client._request("GET", "/info").status_code == 200
    assert abs(client.signer.offset) < 5
    client.close()


def test_a_restart_forgets_neither_nonces_nor_rate_buckets(start_coordinator) -> None:  # noqa: ANN001
    """A request signed with a clock 30 s ahead stays fresh across a restart within those 30 s: it
    must still be refused as a replay. A slow clock right after a restart is no strike. A worker that
    spent its burst does not get a new one by a restart."""
    coordinator = start_coordinator(LIMITED)
    client, worker_id = register(coordinator)
    ahead = signed(client, 30.0)
    assert send(coordinator, ahead) == 503
    coordinator.restart()
    assert send(coordinator, ahead) == 401
    assert [send(coordinator, signed(client, -3.0)) for _ in range(6)] == [503] * 6
    spent = [send(coordinator, signed(client)) for _ in range(BURST)]
    assert 429 in spent
    coordinator.restart()
    assert send(coordinator, signed(client)) == 429
    assert coordinator.violations(worker_id) == 0
    client.close()


def test_junk_sent_with_a_workers_token_spends_the_senders_allowance(start_coordinator) -> None:  # noqa: ANN001
    """An observer with the worker's token sends more junk signatures than a whole burst, from its
    own address: its address runs out (429), the worker's allowance is untouched."""
    coordinator = start_coordinator(LIMITED)
    client, worker_id = register(coordinator)
    junk = {**signed(client), **Signer(Ed25519PrivateKey.generate()).headers("POST", PATH, BODY)}
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.9"), timeout=10) as observer:
        statuses = [
            observer.post(coordinator.url + PATH, content=BODY, headers=junk).status_code
            for _ in range(BURST + 3)
        ]
    assert statuses == [401] * BURST + [429] * 3, statuses
    assert send(coordinator, signed(client)) == 503  # admitted: not a 429
    assert coordinator.violations(worker_id) == 0
    client.close()
