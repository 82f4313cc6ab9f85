"""Routes by measured latency, end to end on loopback: a real coordinator (its HTTP app under
uvicorn), two real holders of stage 1 (`StageServer`s of the tiny model), one of them behind a
`DelayProxy` that adds a round trip, and a real driver (`PipelineEngine`) that leases, generates
through the route it is given and sends its hop timings with its next lease request, as the
worker loop does. Every request is signed and checked as in a run.

The far holder announces the higher rate, so rate alone would route through it; once the driver has
measured both, its leases go to the near one. The far holder's figure shows in `/v1/stages`, and a
lease request whose timings are out of bounds or name another driver's hop is refused with a 422.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from benchmarks.pipeline.delay_proxy import DelayProxy
from decentrl.client import CoordinatorClient, RequestRejected
from decentrl.config import (
    LOOPBACK_NETWORKS,
    CoordinatorConfig,
    ModelConfig,
    RunConfig,
    TrustConfig,
    WeightsConfig,
)
from decentrl.coordinator.http.app import create_app
from decentrl.model.stages import load_stage
from decentrl.model.tiny import build_tiny, save_model_dir
from decentrl.protocol import HopTiming, LeaseRequest, RegisterRequest
from decentrl.stage_wire import StageAnnounce
from decentrl.trust.identity import Signer
from decentrl.worker.pipeline_engine import PipelineEngine
from decentrl.worker.stage_server import StageServer
from decentrl.worker.stage_versions import StageVersions

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ADDED_RTT_S = 0.08
LEASES = 7


class Run:
    """The coordinator on a free loopback port, version 0 of the tiny model published (as a row:
    nobody fetches weights here, each party loads its stage from the model directory)."""

    def __init__(self, tmp_path: Path):
        model, tokenizer = build_tiny(ModelConfig())
        self.model_dir = save_model_dir(model, tokenizer, tmp_path / "model")
        self.state = model.state_dict()
        self.eos, self.pad = [tokenizer.eos_token_id], tokenizer.pad_token_id
        config = RunConfig(
            model=ModelConfig(num_stages=2),
            coordinator=CoordinatorConfig(
                group_size=2, max_new_tokens=8, lease_seconds=60, max_pending_groups=64
            ),
            trust=TrustConfig(verify_fraction=0.0, lease_groups_new=32),
            weights=WeightsConfig(peer_networks=LOOPBACK_NETWORKS),
        )
        app = create_app(config, tmp_path / "run", self.model_dir)
        self.context, self.tokens = app.state.context, app.state.tokens
        with self.context.store.transaction() as db:
            db.execute(
                "INSERT INTO weights (version, path, sha256, num_bytes, created) VALUES (0, 'x', 'h', 1, 0)"
            )
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        self.clients: list[CoordinatorClient] = []

    def join(self, name: str) -> tuple[CoordinatorClient, Signer, str]:
        """A registered worker: its client (signing every request), its key, its id."""
        client = CoordinatorClient(self.url, max_wait=30)
        client.signer = Signer(Ed25519PrivateKey.generate())
        registered = client.register(RegisterRequest(name=name), self.tokens.enroll)
        client.token = registered.token
        self.clients.append(client)
        return client, client.signer, registered.worker_id

    def stage(self, index: int) -> StageVersions:
        assert self.context.stage_map is not None
        versions = StageVersions(load_stage(self.model_dir, self.context.stage_map, index))
        versions.load_weights({name: self.state[name] for name in versions.stage.names}, 0)
        return versions

    def stages_listing(self) -> dict:
        headers = {"Authorization": f"Bearer {self.tokens.trainer}"}
        return httpx.get(f"{self.url}/v1/stages", headers=headers, timeout=10).json()

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    started = Run(tmp_path)
    yield started
    started.close()


def test_a_driver_is_routed_to_the_nearer_of_two_holders_once_it_has_measured_both(run: Run) -> None:
    servers, proxy = [], None
    try:
        holders = {}
        for name, rate in (("near", 10.0), ("far", 1000.0)):
            client, _, holder_id = run.join(name)
            server = StageServer(run.stage(1), client, holder_id).start()
            servers.append(server)
            url = server.url
            if name == "far":
                host, port = server.http.server_address[:2]
                proxy = DelayProxy(str(host), int(port), rtt_s=ADDED_RTT_S).start()
                url = proxy.url
            announce = StageAnnounce(stage=1, url=url, version=0, held_versions=[0], tokens_per_second=rate)
            assert client.announce_stage(announce).relayed is False
            holders[holder_id] = name
        client, signer, _ = run.join("driver")
        driver = PipelineEngine(run.stage(0), signer, run.eos, run.pad, coordinator=client)
        routed = []
        for number in range(LEASES):
            # what `worker/loop.py` sends: the timings of the leases generated since the last request
            request = LeaseRequest(policy_version=0, stage=0, hop_timings=driver.hop_timer.take())
            lease = client.lease(request)
            assert lease is not None and lease.route is not None
            routed.append(holders[lease.route[0].worker_id])
            assert driver.bind(lease)
            prompts = [task.prompt_token_ids for task in lease.tasks for _ in task.slots]
            driver.generate(prompts, lease.sampling, seed=number)
        client.lease(LeaseRequest(policy_version=0, stage=0, hop_timings=driver.hop_timer.take()))
        listing = {holders[h["worker_id"]]: h["step_ms"] for h in run.stages_listing()["holders"]}

        hostile = HopTiming(lease_id=lease.lease_id, stage=1, worker_id="someone-else", steps=1, step_ms=1.0)
        with pytest.raises(RequestRejected) as foreign:
            client.lease(LeaseRequest(policy_version=0, stage=0, hop_timings=[hostile]))
        absurd = hostile.model_copy(update={"worker_id": lease.route[0].worker_id, "step_ms": -5.0})
        with pytest.raises(RequestRejected) as negative:  # built unchecked, as a hostile driver would
            client.lease(LeaseRequest.model_construct(policy_version=0, stage=0, hop_timings=[absurd]))
    finally:
        for server in servers:
            server.close()
        if proxy is not None:
            proxy.close()

    # rate alone says far; the unmeasured near one is tried next; then near, every time
    assert routed == ["far", "near"] + ["near"] * (LEASES - 2), routed
    assert listing["far"]["drivers"] == listing["near"]["drivers"] == 1
    assert listing["far"]["median_ms"] > listing["near"]["median_ms"] + 0.75 * ADDED_RTT_S * 1000, listing
    assert foreign.value.status == 422 and "not a hop of a lease of yours" in foreign.value.detail
    assert negative.value.status == 422
    assert "hop_timings.0.step_ms: Input should be greater than or equal to 0" in negative.value.detail
