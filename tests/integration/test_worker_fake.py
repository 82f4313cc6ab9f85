"""The worker (real HF engine, tiny model) against a scripted stand-in of the coordinator's API.

The stand-in lets a test decide every answer (no weights yet, stale, expired, revoked
credentials, rejections) and records what the worker sent; `test_worker.py` runs the real one.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from fastapi import FastAPI, Header, Request, Response
from fastapi.responses import JSONResponse

from decentrl.config import ModelConfig, WorkerConfig
from decentrl.protocol import Lease, LeaseRequest, RolloutSubmission, SamplingParams, ServerInfo, TaskSpec
from decentrl.trust.identity import registration_message
from decentrl.worker import run_worker
from decentrl.worker.loop import MAX_CONSECUTIVE_REJECTIONS

pytestmark = pytest.mark.integration

ENROLL = "enroll-secret"
MODEL_FILES = ["config.json", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, list[bytes]]:
    """A tiny model directory (no weights) and two weight versions as safetensors bytes."""
    import torch
    from safetensors.torch import save

    from decentrl.model.tiny import build_tiny, save_model_dir

    model, tokenizer = build_tiny(ModelConfig(hidden_size=64, num_heads=2, intermediate_size=64))
    model_dir = save_model_dir(model, tokenizer, tmp_path_factory.mktemp("tiny"))
    versions = []
    for version in range(2):
        torch.manual_seed(version)
        state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        state = {k: v + 0.01 * torch.randn_like(v) for k, v in state.items()}
        versions.append(save(state))
    return model_dir, versions


class SignedVersions:
    """The two versions as the real trainer publishes them: signed snapshot 0, signed delta 1."""

    def __init__(self, versions: list[bytes], key_path: Path):
        from safetensors.torch import load

        from decentrl.weights.codec import published_state, state_hash
        from decentrl.weights.publisher import build_manifest
        from decentrl.weights.signing import load_or_create_key, public_key_hex, sign

        key = load_or_create_key(key_path)
        self.public_key = public_key_hex(key)
        self.manifests: dict[tuple[int, str], str] = {}
        self.chunks: dict[str, bytes] = {}
        self.hashes: list[str] = []
        previous = None
        for version, blob in enumerate(versions):
            state = published_state(load(blob), "bfloat16")
            self.hashes.append(state_hash(state))
            parent_hash = self.hashes[-2] if previous is not None else None
            manifest, pieces = build_manifest(
                version, previous, state, "bfloat16", 1 << 16, self.hashes[-1], parent_hash
            )
            self.manifests[(version, manifest.kind)] = sign(manifest, key).model_dump_json()
            self.chunks.update({entry.sha256: bytes(data) for entry, data in pieces})
            previous = state

    def index(self, published: int) -> list[dict]:
        return [
            {"version": v, "kind": kind, "payload_bytes": 1, "state_sha256": self.hashes[v]}
            for v, kind in self.manifests
            if v <= published
        ]


class FakeCoordinator:
    def __init__(self, model_dir: Path, versions: list[bytes]):
        self.model_dir = model_dir
        self.versions = versions
        self.signed = SignedVersions(versions, model_dir / "trainer-key.pem")
        self.published = -1
        self.tokens: set[str] = set()
        self.registrations = 0
        self.identities: dict[str, tuple[str, str]] = {}
        """Public key -> (worker id, its token): as the coordinator, registering a key again keeps
        its worker and replaces its token (requests still carrying the old one are refused)."""
        self.refused_submissions: list[str] = []
        """Lease ids of submissions refused for their token."""
        self.lease_requests: list[LeaseRequest] = []
        self.leases: dict[str, Lease] = {}
        self.submissions: list[RolloutSubmission] = []
        self.submit_faults: list[tuple[int, str]] = []
        self.lease_issued = threading.Event()
        self.staleness_allowed = 0
        """Versions a lease request may be behind the published one (beyond: 409)."""
        self.manifest_delay: dict[int, float] = {}
        """Seconds the manifest of a version takes to answer (a slow weight download)."""
        self.app = self._build()

    def _authorized(self, authorization: str | None) -> bool:
        return authorization is not None and authorization.removeprefix("Bearer ") in self.tokens

    def _build(self) -> FastAPI:
        app = FastAPI()
        unauthorized = JSONResponse({"detail": "unknown worker token"}, status_code=401)

        @app.post("/v1/workers/challenge")
        async def challenge():
            return {"challenge": f"fake-{self.registrations}", "server_time": time.time()}

        @app.post("/v1/workers/register")
        async def register(request: Request, authorization: str = Header(None)):
            if authorization != f"Bearer {ENROLL}":
                return unauthorized
            body = await request.json()
            key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(body["public_key"]))
            key.verify(
                bytes.fromhex(body["proof"]), registration_message(body["challenge"], body["public_key"])
            )
            self.registrations += 1
            token = f"token-{self.registrations}"
            worker_id, previous = self.identities.get(body["public_key"], (f"w{self.registrations}", ""))
            self.tokens.discard(previous)
            self.tokens.add(token)
            self.identities[body["public_key"]] = (worker_id, token)
            return {"worker_id": worker_id, "token": token}

        @app.get("/v1/info")
        async def info(authorization: str = Header(None)):
            if not self._authorized(authorization):
                return unauthorized
            return ServerInfo(
                run_id="fake",
                vocab_size=99,
                eos_token_ids=[1],
                pad_token_id=0,
                group_size=2,
                max_staleness=1,
                sampling=SamplingParams(temperature=1.0, max_new_tokens=6),
                latest_version=self.published if self.published >= 0 else None,
                model_files=MODEL_FILES,
                trainer_public_key=self.signed.public_key,
            ).model_dump()

        @app.get("/v1/model/files/{name}")
        async def model_file(name: str):
            return Response((self.model_dir / name).read_bytes())

        @app.get("/v1/weights/latest")
        async def latest():
            if self.published < 0:
                return JSONResponse({"detail": "no weights yet"}, status_code=404)
            sha = self.signed.hashes[self.published]
            return {"version": self.published, "sha256": sha, "num_bytes": 1, "created_unix": 0.0}

        @app.get("/v1/weights/index")
        async def index():
            return self.signed.index(self.published)

        @app.get("/v1/weights/manifests/{version}/{kind}")
        async def manifest(version: int, kind: str):
            await asyncio.sleep(self.manifest_delay.get(version, 0.0))
            return Response(self.signed.manifests[(version, kind)], media_type="application/json")

        @app.get("/v1/weights/chunks/{digest}")
        async def chunk(digest: str):
            return Response(self.signed.chunks[digest])

        @app.get("/v1/weights/peers")
        async def peers():
            return {"peers": []}

        @app.post("/v1/leases")
        async def lease(request: LeaseRequest, authorization: str = Header(None)):
            if not self._authorized(authorization):
                return unauthorized
            self.lease_requests.append(request)
            if not 0 <= self.published - request.policy_version <= self.staleness_allowed:
                return JSONResponse({"detail": f"engine too stale, need v{self.published}"}, status_code=409)
            number = len(self.leases)
            tasks = [
                TaskSpec(
                    task_id=f"t{number}-{i}",
                    group_id=f"g{number}-{i}",
                    env="arithmetic",
                    prompt_token_ids=[4, 5, 75, 6, 83 + i],
                    slots=[0, 1],
                )
                for i in range(request.max_groups)
            ]
            lease = Lease(
                lease_id=f"lease-{number}",
                deadline_unix=time.time() + 30,
                sampling=SamplingParams(temperature=1.0, max_new_tokens=6),
                tasks=tasks,
            )
            self.leases[lease.lease_id] = lease
            self.lease_issued.set()
            return lease.model_dump()

        @app.post("/v1/rollouts")
        async def rollouts(submission: RolloutSubmission, authorization: str = Header(None)):
            if not self._authorized(authorization):
                self.refused_submissions.append(submission.rollouts[0].lease_id)
                return unauthorized
            if self.submit_faults:
                status, detail = self.submit_faults.pop(0)
                return JSONResponse({"detail": detail}, status_code=status)
            self.submissions.append(submission)
            accepted = [f"{r.lease_id}/{r.task_id}/{r.slot}" for r in submission.rollouts]
            return {"accepted": accepted, "groups_completed": len(submission.rollouts) // 2}

        return app


@pytest.fixture
def fake(tiny) -> Iterator[tuple[FakeCoordinator, str]]:
    coordinator = FakeCoordinator(*tiny)
    server = uvicorn.Server(uvicorn.Config(coordinator.app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield coordinator, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def start_worker(config: WorkerConfig) -> tuple[threading.Thread, threading.Event, list[int]]:
    stop, result = threading.Event(), []
    thread = threading.Thread(target=lambda: result.append(run_worker(config, stop)), daemon=True)
    thread.start()
    return thread, stop, result


def test_worker_follows_versions_and_survives_rejections(fake, tmp_path):
    coordinator, url = fake
    config = WorkerConfig(
        coordinator_url=url, token=ENROLL, name="w", state_dir=str(tmp_path), groups_per_lease=2
    )
    thread, stop, result = start_worker(config)
    wait_for(lambda: all((tmp_path / "model" / name).is_file() for name in MODEL_FILES))
    time.sleep(0.5)
    assert not coordinator.lease_requests, "a worker must not lease before any weights exist"
    credentials = json.loads((tmp_path / "credentials.json").read_text())
    assert credentials == {
        "worker_id": "w1",
        "token": "token-1",
        "coordinator_url": url,
        "engine_class": "hf/float32/cpu",
    }
    assert (tmp_path / "credentials.json").stat().st_mode & 0o777 == 0o600
    assert all((tmp_path / "model" / name).is_file() for name in MODEL_FILES)

    coordinator.published = 0
    wait_for(lambda: len(coordinator.submissions) >= 1)
    first = coordinator.submissions[0]
    lease = coordinator.leases[first.rollouts[0].lease_id]
    assert [(r.task_id, r.slot) for r in first.rollouts] == [
        (t.task_id, s) for t in lease.tasks for s in t.slots
    ]
    for rollout in first.rollouts:
        (segment,) = rollout.segments
        assert segment.source == "model" and segment.policy_versions == [0] * len(segment.token_ids)
        assert len(segment.logprobs) == len(segment.token_ids) and all(lp <= 0 for lp in segment.logprobs)
        assert (
            rollout.prompt_token_ids
            == next(t for t in lease.tasks if t.task_id == rollout.task_id).prompt_token_ids
        )
        assert rollout.finish_reason == ("stop" if segment.token_ids[-1] == 1 else "length")
        assert rollout.timings["generate_s"] > 0

    # An expired lease and a rejection are absorbed; a new version is loaded before the next lease.
    coordinator.submit_faults = [(410, "lease expired"), (422, "bad slot")]
    coordinator.published = 1
    done = len(coordinator.submissions)

    def on_version_one(submission) -> bool:  # noqa: ANN001 - a RolloutSubmission
        return all(s.policy_versions[0] == 1 for r in submission.rollouts for s in r.segments)

    # A worker may still generate the lease it held on the version before (the staleness bound
    # allows it; worker/loop.py), so the next submissions reach version 1 within a lease or two.
    wait_for(lambda: any(on_version_one(s) for s in coordinator.submissions[done:]))
    assert coordinator.submit_faults == []
    assert coordinator.lease_requests[-1].policy_version == 1
    assert thread.is_alive()

    stop.set()
    thread.join(30)
    assert result == [0]

    # A restart reuses the saved credentials; once they are revoked mid-run (its next lease,
    # asked during a generation, and its submission are in flight with the old token), it
    # registers again once, keeps its identity, and sends the refused work again.
    before = len(coordinator.submissions)
    thread, stop, result = start_worker(config)
    wait_for(lambda: len(coordinator.submissions) > before)
    assert coordinator.registrations == 1
    coordinator.tokens.clear()
    revoked = len(coordinator.submissions)
    wait_for(lambda: len(coordinator.submissions) >= revoked + 3)
    assert coordinator.registrations == 2, "one registration for all the requests refused"
    submitted = {s.rollouts[0].lease_id for s in coordinator.submissions}
    assert set(coordinator.refused_submissions) <= submitted, "refused work was not sent again"
    assert thread.is_alive()
    stop.set()
    thread.join(30)
    assert result == [0]
    saved = json.loads((tmp_path / "credentials.json").read_text())
    assert (saved["worker_id"], saved["token"]) == ("w1", "token-2")


def test_worker_generates_while_a_version_downloads(fake, tmp_path):
    """A newer version is fetched in the background: the worker keeps generating on the one it
    holds, and the new one is in the engine once its download finishes."""
    coordinator, url = fake
    coordinator.published = 0
    coordinator.staleness_allowed = 1
    config = WorkerConfig(coordinator_url=url, token=ENROLL, state_dir=str(tmp_path), groups_per_lease=1)
    thread, stop, result = start_worker(config)
    try:
        wait_for(lambda: len(coordinator.submissions) >= 1)
        coordinator.manifest_delay[1] = 3.0
        coordinator.published = 1
        published, before = time.monotonic(), len(coordinator.submissions)
        wait_for(lambda: any(v == 1 for s in coordinator.submissions for v in versions(s)))
        assert time.monotonic() - published >= 3.0
        during = [s for s in coordinator.submissions[before:] if versions(s) == {0}]
        # Submissions on v0 went on while v1 downloaded (a blocking load would allow at most the
        # one lease already generating and the one asked during it).
        assert len(during) >= 3, len(during)
        assert max(r.policy_version for r in coordinator.lease_requests) == 1
    finally:
        stop.set()
        thread.join(30)
    assert result == [0]


def versions(submission: RolloutSubmission) -> set[int]:
    return {v for r in submission.rollouts for s in r.segments for v in s.policy_versions or []}


def test_worker_exits_2_after_consecutive_rejections(fake, tmp_path):
    coordinator, url = fake
    coordinator.published = 0
    coordinator.submit_faults = [(422, "every rollout is malformed")] * 25
    config = WorkerConfig(coordinator_url=url, token=ENROLL, state_dir=str(tmp_path), groups_per_lease=1)
    thread, _, result = start_worker(config)
    thread.join(120)
    assert result == [2]
    # The limit's rejections, plus at most the one submission already in flight in the background
    # when the last rejection arrived (sent, or cancelled at shutdown before it started).
    consumed = 25 - len(coordinator.submit_faults)
    assert MAX_CONSECUTIVE_REJECTIONS <= consumed <= MAX_CONSECUTIVE_REJECTIONS + 1, consumed


def test_same_lease_gives_the_same_samples(fake, tmp_path):
    from decentrl.engines.hf import HFEngine
    from decentrl.envs.player import lease_seed

    model_dir, versions = fake[0].model_dir, fake[0].versions
    from safetensors.torch import load

    engine = HFEngine.from_model_dir(model_dir)
    engine.load_weights(load(versions[0]), 0)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    prompts = [[4, 5, 75, 6, 83]] * 4
    first = engine.generate(prompts, sampling, seed=lease_seed("lease-7"))
    again = engine.generate(prompts, sampling, seed=lease_seed("lease-7"))
    assert [c.token_ids for c in first] == [c.token_ids for c in again]


def test_sigterm_finishes_the_step_then_exits_0(fake, tmp_path):
    coordinator, url = fake
    coordinator.published = 0
    config = WorkerConfig(
        coordinator_url=url, token=ENROLL, state_dir=str(tmp_path), groups_per_lease=1, delay_seconds=2.0
    )
    code = "import sys; from decentrl.config import WorkerConfig; from decentrl.worker import main_worker; "
    code += "sys.exit(main_worker(WorkerConfig.model_validate_json(sys.argv[1])))"
    process = subprocess.Popen(
        [sys.executable, "-c", code, config.model_dump_json()],
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert coordinator.lease_issued.wait(120), "the worker never leased"
        process.send_signal(signal.SIGTERM)  # mid-step: generating or in the 2 s delay
        assert process.wait(60) == 0
    finally:
        process.kill()
    log = process.stderr.read()
    assert 1 <= len(coordinator.leases) <= 2, log  # the next lease may be asked during the step
    assert len(coordinator.submissions) == 1, log
    assert "finishing the current step" in log and "stopped: 1 submissions" in log
