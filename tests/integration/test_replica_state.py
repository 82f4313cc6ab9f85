"""What replicas of one run must share through PostgreSQL: spent nonces, peer lists, rate buckets.

Two real coordinator processes (`coordinator.server.serve`) on one real PostgreSQL database, as
behind a load balancer. An observer who captured a signed request on its way to one replica sends
the same bytes to the other within the freshness window: it must be refused as a replay (and be no
strike against the worker). A peer announced to one replica is listed by the other.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx
import psycopg
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from unit.test_coordinator_store import write_model_dir

from benchmarks.coordinator.server import Coordinator, launch, run_config
from decentrl.client import CoordinatorClient
from decentrl.coordinator.db.store import Store, load_buckets, save_buckets
from decentrl.protocol import API_PREFIX, LeaseRequest, PeerAnnounce, RegisterRequest
from decentrl.trust.identity import Signer

pytestmark = pytest.mark.integration


def start_replicas(root: Path, store: str) -> list[Coordinator]:
    """Two replicas on a vocabulary-only model, one after the other (the first writes the run's tokens); no version is published, so an admitted
    lease answers 503 ("no policy version yet") and `GET /v1/weights/latest` 404."""
    model_dir = write_model_dir(root / "model")  # the coordinator reads the vocabulary only
    run = run_config(argparse.Namespace(group_size=2, workers=2), 20, store)
    started: list[Coordinator] = []
    try:
        for i in range(2):
            started.append(launch(run, root / "run", model_dir, root / f"coordinator-{i}.log"))
    except BaseException:
        for coordinator in started:
            coordinator.stop()
        raise
    return started


def registered(url: str, enroll_token: str, name: str) -> CoordinatorClient:
    client = CoordinatorClient(url, max_wait=10)
    client.signer = Signer(Ed25519PrivateKey.generate())
    request = RegisterRequest(name=name, public_key=client.signer.public_key)
    client.token = client.register(request, enroll_token).token
    return client


def captured(client: CoordinatorClient, method: str, path: str, body: bytes = b"") -> dict[str, str]:
    """The headers of one signed request, as an observer on the wire would copy them."""
    headers = client.signer.headers(method, path, body, now=time.time())
    return {"Authorization": f"Bearer {client.token}", "Content-Type": "application/json", **headers}


def test_a_request_captured_at_one_replica_is_refused_by_the_other(tmp_path: Path, postgres_url: str) -> None:
    coordinators = start_replicas(tmp_path, postgres_url)
    first, second = (c.endpoint["url"] for c in coordinators)
    enroll = coordinators[0].endpoint["enroll_token"]
    try:
        client = registered(first, enroll, "victim")
        lease_path = f"{API_PREFIX}/leases"
        body = LeaseRequest(policy_version=0, max_groups=1).model_dump_json().encode()
        headers = captured(client, "POST", lease_path, body)
        assert httpx.post(first + lease_path, content=body, headers=headers).status_code == 503
        replayed = httpx.post(second + lease_path, content=body, headers=headers)
        assert replayed.status_code == 401 and "replayed" in replayed.json()["detail"], replayed.text

        latest = f"{API_PREFIX}/weights/latest"
        headers = captured(client, "GET", latest)
        assert httpx.get(first + latest, headers=headers).status_code == 404
        replayed = httpx.get(second + latest, headers=headers)
        assert replayed.status_code == 401 and "replayed" in replayed.json()["detail"], replayed.text

        # A peer announced to one replica is offered by the other.
        client.announce_peer(PeerAnnounce(url="http://127.0.0.1:9", version=-1))
        other = registered(second, enroll, "asker")
        assert [peer.url for peer in other.peers()] == ["http://127.0.0.1:9"]
        other.close()
        client.close()
    finally:
        for coordinator in coordinators:
            coordinator.stop()
    with psycopg.connect(postgres_url) as db:
        strikes = db.execute("SELECT COUNT(*) FROM events WHERE kind = 'violation'").fetchone()[0]
    assert strikes == 0, "a replay is never the worker's strike"


def test_replicas_saving_rate_buckets_keep_the_emptier_one(tmp_path: Path) -> None:
    """Two replicas save the same worker's bucket into one store: whichever saves last, the one that
    spent more is kept (compared at the same time), so a restart hands out no fresh burst."""
    store = Store(tmp_path / "coordinator.db")
    rate, burst = 1.0, 10.0
    with store.transaction() as db:
        save_buckets(db, "workers", {"w": (2.0, 100.0), "idle": (9.0, 100.0)}, rate, burst)
        # The other replica: w holds 5 tokens at t = 101 (the first's 2 would be 3 by then: kept);
        # `idle` saved at 100 with 9 tokens is full by 102 and dropped.
        save_buckets(db, "workers", {"w": (5.0, 101.0), "x": (0.0, 102.0)}, rate, burst)
        assert load_buckets(db, "workers") == {"w": (2.0, 100.0), "x": (0.0, 102.0)}
        save_buckets(db, "workers", {"w": (0.5, 101.0)}, rate, burst)  # emptier now: replaces
        assert load_buckets(db, "workers")["w"] == (0.5, 101.0)
    store.close()
