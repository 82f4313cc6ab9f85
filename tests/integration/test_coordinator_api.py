"""The coordinator's HTTP API against a tiny model directory, through FastAPI's TestClient.

Every rejection test also checks that the store is unchanged apart from the one `rejected` event.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi.testclient import TestClient
from tokenizers import Tokenizer

from decentrl.config import CoordinatorConfig, ModelConfig, RunConfig, TrustConfig
from decentrl.config.rewards import RewardConfig
from decentrl.coordinator.http.app import create_app
from decentrl.coordinator.pipeline.batching import WORKERS_SEEN_S
from decentrl.trust.identity import Signer

EOS = 1


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from decentrl.model.tiny import build_tiny, save_model_dir

    return save_model_dir(*build_tiny(ModelConfig()), tmp_path_factory.mktemp("tiny-model"))


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class SignWorkers:
    """An auth callable for the test client: signs each request that carries a registered worker's
    token with that worker's key (a streamed body is left unsigned: it is refused before checking)."""

    def __init__(self, clock: Clock) -> None:
        self.signers: dict[str, Signer] = {}
        self.clock = clock

    def __call__(self, request):
        signer = self.signers.get(request.headers.get("authorization", "").removeprefix("Bearer "))
        if signer is not None:
            try:
                body = request.content
            except Exception:  # a streamed body: not readable up front
                body = b""
            path = request.url.raw_path.decode()
            request.headers.update(signer.headers(request.method, path, body, self.clock()))
        return request


class Harness:
    """One coordinator app on a run directory, with helpers that speak its protocol."""

    def __init__(
        self, run_dir: Path, model_dir: Path, reward: dict | None = None, **coordinator: object
    ) -> None:
        settings = {"group_size": 2, "max_new_tokens": 8, "max_staleness": 1, "max_body_bytes": 20_000}
        # No sampled verification here (it holds groups back for a verifier; tests/adversarial/ covers it).
        self.config = RunConfig(
            coordinator=CoordinatorConfig(**(settings | coordinator)),
            trust=TrustConfig(verify_fraction=0.0),
            reward=RewardConfig.model_validate({"pool_size": 1} | (reward or {})),
        )
        self.run_dir, self.model_dir, self.clock = run_dir, model_dir, Clock()
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.start()

    state_hashes: dict[int, str]

    def start(self) -> None:
        self.state_hashes = getattr(self, "state_hashes", {})
        self.client = TestClient(create_app(self.config, self.run_dir, self.model_dir, clock=self.clock))
        self.client.__enter__()
        self.signers = getattr(self, "signers", SignWorkers(self.clock))
        self.client.auth = self.signers
        tokens = json.loads((self.run_dir / "tokens.json").read_text())
        self.enroll = {"Authorization": f"Bearer {tokens['enroll_token']}"}
        self.trainer = {"Authorization": f"Bearer {tokens['trainer_token']}"}

    def stop(self) -> None:
        self.client.__exit__(None, None, None)

    def register(self, name: str = "w") -> dict:
        """A new worker key; its requests are signed (see `SignWorkers`)."""
        signer = Signer(Ed25519PrivateKey.generate())
        challenge = self.client.post("/v1/workers/challenge").json()["challenge"]
        body = {"name": name, "public_key": signer.public_key, "challenge": challenge}
        body["proof"] = signer.prove(challenge)
        answer = self.client.post("/v1/workers/register", json=body, headers=self.enroll)
        assert answer.status_code == 200, answer.text
        self.signers.signers[answer.json()["token"]] = signer
        return {"Authorization": f"Bearer {answer.json()['token']}"}

    def publish(self, version: int, body: bytes | None = None, kind: str | None = None) -> dict:
        """Publish `version` as a signed manifest over one opaque chunk (`body`); the coordinator
        never decodes payloads, so any bytes do (docs/weights.md)."""
        from decentrl.weights.manifest import ChunkEntry, Manifest
        from decentrl.weights.signing import load_or_create_key, public_key_hex, sign

        key = load_or_create_key(self.run_dir.parent / "trainer-key.pem")
        answer = self.client.put(
            "/v1/trainer/key", json={"public_key": public_key_hex(key)}, headers=self.trainer
        )
        assert answer.status_code == 200, answer.text
        body = body if body is not None else f"weights {version}".encode()
        digest = hashlib.sha256(body).hexdigest()
        answer = self.client.put(f"/v1/weights/chunks/{digest}", content=body, headers=self.trainer)
        assert answer.status_code == 200, answer.text
        kind = kind or ("snapshot" if version == 0 else "delta")
        parent = self.state_hashes.get(version - 1) if kind == "delta" else None
        manifest = Manifest(
            version=version,
            kind=kind,
            parent=version - 1 if kind == "delta" else None,
            parent_state_sha256=parent,
            dtype="bfloat16",
            tensors=[],
            chunks=[ChunkEntry(sha256=digest, offset=0, size=len(body))],
            payload_bytes=len(body),
            state_sha256=hashlib.sha256(b"state " + body).hexdigest(),
        )
        path = f"/v1/weights/manifests/{version}/{kind}"
        answer = self.client.put(path, content=sign(manifest, key).model_dump_json(), headers=self.trainer)
        assert answer.status_code == 200, answer.text
        self.state_hashes[version] = manifest.state_sha256
        return answer.json()

    def lease(self, worker: dict, version: int = 0, max_groups: int = 1) -> dict:
        answer = self.client.post(
            "/v1/leases", json={"policy_version": version, "max_groups": max_groups}, headers=worker
        )
        assert answer.status_code == 200, answer.text
        return answer.json()

    def rollout(
        self,
        lease: dict,
        task: int = 0,
        slot: int = 0,
        correct: bool = True,
        version: int = 0,
        text: str | None = None,
    ) -> dict:
        spec = lease["tasks"][task]
        prompt = self.tokenizer.decode(spec["prompt_token_ids"])
        answer = str(eval(prompt.rstrip("=")))  # prompts are "<int><+|-><int>="
        if text is None:
            text = answer if correct else answer + "9"
        token_ids = self.tokenizer.encode(text).ids + [EOS]
        segment = {
            "source": "model",
            "token_ids": token_ids,
            "logprobs": [-0.5] * len(token_ids),
            "policy_versions": [version] * len(token_ids),
        }
        return {
            "lease_id": lease["lease_id"],
            "task_id": spec["task_id"],
            "slot": spec["slots"][slot],
            "prompt_token_ids": spec["prompt_token_ids"],
            "segments": [segment],
            "sampling": lease["sampling"],
            "finish_reason": "stop",
            "claimed_reward": 0.0 if correct else 1.0,
        }

    def submit(self, worker: dict, *rollouts: dict, settle: bool = True):
        """Submit; then (by default) wait until the scoring pool has scored what was accepted."""
        answer = self.client.post("/v1/rollouts", json={"rollouts": list(rollouts)}, headers=worker)
        if settle:
            self.settle()
        return answer

    def settle(self, timeout: float = 60.0, remote: bool = False) -> None:
        """Wait until no reward is pending (`remote`: none pending in the pool; reward-model terms
        may still wait for a scorer)."""
        query = "SELECT COUNT(*) FROM reward_pending" + (" WHERE state = 'local'" if remote else "")
        deadline = time.monotonic() + timeout
        while self.query(query)[0][0]:
            assert time.monotonic() < deadline, f"rewards still pending after {timeout}s"
            time.sleep(0.02)

    def query(self, sql: str, *args: object) -> list[tuple]:
        """Read the store directly (SQLite or PostgreSQL alike, through the coordinator's own store)."""
        with self.client.app.state.context.store.transaction() as db:
            return [tuple(row) for row in db.execute(sql, args).fetchall()]

    def counts(self) -> dict[str, int]:
        """Rows per table, except the bookkeeping a rejection itself writes: its event, the worker's
        reputation (strikes), which is the point of counting rejections, and the signed request's
        nonce (recorded before the body is read, so that it cannot be sent again)."""
        tables = [row[0] for row in self.query("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {
            table: self.query(f"SELECT COUNT(*) FROM {table}")[0][0]
            for table in tables
            if table not in ("events", "reputation", "nonces")
        }

    def rejections(self) -> list[str]:
        return [
            row[0] for row in self.query("SELECT reason FROM events WHERE kind = 'rejected' ORDER BY seq")
        ]

    def stats(self) -> dict:
        return self.client.get("/v1/stats", headers=self.trainer).json()


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest) -> str:
    """Every API test runs on both stores; PostgreSQL gets a fresh database on a real server."""
    return "sqlite" if request.param == "sqlite" else request.getfixturevalue("postgres_url")


@pytest.fixture
def harness(tmp_path: Path, model_dir: Path, store: str):
    harness = Harness(tmp_path / "run", model_dir, store=store)
    yield harness
    harness.stop()


def test_registration_and_auth_failures(harness: Harness) -> None:
    client = harness.client
    assert client.post("/v1/workers/register", json={"name": "w"}).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    answer = client.post("/v1/workers/register", json={"name": "w"}, headers=wrong)
    assert answer.status_code == 401 and "enrollment token" in answer.json()["detail"]
    worker = harness.register("alice")
    assert client.get("/v1/info", headers=worker).json()["vocab_size"] == 99
    assert client.post("/v1/workers/register", json={"name": "w"}, headers=worker).status_code == 401
    assert client.post("/v1/leases", json={"policy_version": 0}, headers=harness.trainer).status_code == 401
    batch = {"policy_version": 0, "max_groups": 1}
    assert client.post("/v1/trainer/batches", json=batch, headers=worker).status_code == 401
    assert client.get("/v1/stats").status_code == 401
    assert client.get("/v1/health").json() == {"status": "ok", "latest_version": None}
    stored = harness.query("SELECT token_sha256 FROM workers")[0][0]
    assert stored == hashlib.sha256(worker["Authorization"].split()[1].encode()).hexdigest()
    assert oct((harness.run_dir / "tokens.json").stat().st_mode & 0o777) == "0o600"


def test_lease_needs_published_and_fresh_policy(harness: Harness) -> None:
    worker = harness.register()
    answer = harness.client.post("/v1/leases", json={"policy_version": 0}, headers=worker)
    assert answer.status_code == 503 and "no policy version" in answer.json()["detail"]
    for version in range(3):
        harness.publish(version)
    answer = harness.client.post("/v1/leases", json={"policy_version": 0}, headers=worker)
    assert answer.status_code == 409 and "load version >= 1" in answer.json()["detail"]
    lease = harness.lease(worker, version=1)
    max_context = ModelConfig().max_positions  # the tiny model's max_position_embeddings
    assert lease["sampling"] == {"temperature": 1.0, "max_new_tokens": 8, "max_context": max_context}
    assert lease["deadline_unix"] == harness.clock.now + harness.config.coordinator.lease_seconds


def test_no_lease_beyond_max_pending_groups(tmp_path: Path, model_dir: Path, store: str) -> None:
    harness = Harness(tmp_path / "run", model_dir, max_pending_groups=1, store=store)
    try:
        worker = harness.register()
        harness.publish(0)
        assert len(harness.lease(worker, max_groups=4)["tasks"]) == 1
        answer = harness.client.post("/v1/leases", json={"policy_version": 0}, headers=worker)
        assert answer.status_code == 204 and answer.content == b""
    finally:
        harness.stop()


def test_trusted_reward_ignores_claims_and_group_ready_when_full(harness: Harness) -> None:
    worker = harness.register()
    harness.publish(0)
    lease = harness.lease(worker)
    answer = harness.submit(worker, harness.rollout(lease, slot=0, correct=True))
    assert answer.status_code == 200, answer.text
    task_id = lease["tasks"][0]["task_id"]
    assert answer.json() == {"accepted": [f"{task_id}-0"], "groups_completed": 0}
    assert harness.query("SELECT state FROM tasks") == [("pending",)]
    answer = harness.submit(worker, harness.rollout(lease, slot=1, correct=False))
    assert answer.json()["groups_completed"] == 1
    assert harness.query("SELECT state FROM tasks") == [("ready",)]
    assert harness.query("SELECT slot, reward FROM rollouts ORDER BY slot") == [(0, 1.0), (1, 0.0)]
    assert harness.query("SELECT state FROM leases") == [("done",)]
    stats = harness.stats()
    assert stats["recent"]["accuracy"] == 0.5 and stats["rollouts_accepted"] == 2


def _mutate(path: str, value: object):
    def apply(rollout: dict) -> None:
        *parents, last = path.split(".")
        node = rollout
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        node[int(last) if last.lstrip("-").isdigit() else last] = value

    return apply


def _too_long(rollout: dict) -> None:
    rollout["segments"][0] = {"source": "model", "token_ids": [5] * 8 + [EOS], "logprobs": [-1.0] * 9}
    rollout["segments"][0]["policy_versions"] = [0] * 9


REJECTIONS = [
    (
        "out_of_vocab",
        _mutate("segments.0.token_ids.0", 99),
        422,
        "token id 99 is outside the vocabulary [0, 99)",
    ),
    ("prompt", _mutate("prompt_token_ids", [4, 5, 83]), 422, "prompt_token_ids differ"),
    (
        "sampling",
        _mutate("sampling", {"temperature": 0.5, "max_new_tokens": 8}),
        422,
        "differs from the leased",
    ),
    ("positive_logprob", _mutate("segments.0.logprobs.0", 0.5), 422, "logprobs must be finite and <= 0"),
    ("missing_logprobs", _mutate("segments.0.logprobs", None), 422, "need logprobs and policy_versions"),
    ("short_versions", _mutate("segments.0.policy_versions", [0]), 422, "same length"),
    ("too_long", _too_long, 422, "exceed max_new_tokens=8"),
    ("no_eos", _mutate("segments.0.token_ids.-1", 5), 422, "not eos"),
    ("future_version", _mutate("segments.0.policy_versions.0", 5), 409, "newer than the latest"),
    ("unknown_lease", _mutate("lease_id", "l-forged"), 404, "unknown lease"),
    ("not_leased", _mutate("slot", 7), 422, "is not part of lease"),
]


@pytest.mark.parametrize(
    ("case", "mutate", "status", "detail"), REJECTIONS, ids=[case[0] for case in REJECTIONS]
)
def test_rejections_store_nothing(
    harness: Harness, case: str, mutate: Callable[[dict], None], status: int, detail: str
) -> None:
    worker = harness.register()
    harness.publish(0)
    lease = harness.lease(worker)
    good = harness.rollout(lease, slot=0)
    bad = harness.rollout(lease, slot=1)
    mutate(bad)
    before = harness.counts()
    answer = harness.submit(worker, good, bad)  # the valid first rollout must not be stored either
    assert answer.status_code == status, answer.text
    assert answer.json()["detail"].startswith("rollouts[1]: ") and detail in answer.json()["detail"]
    assert harness.counts() == before
    assert len(harness.rejections()) == 1
    assert harness.submit(worker, good).status_code == 200  # the lease is still usable


def test_env_segment_may_not_carry_logprobs(harness: Harness) -> None:
    worker = harness.register()
    harness.publish(0)
    rollout = harness.rollout(harness.lease(worker))
    env = {"source": "env", "token_ids": [5], "logprobs": [-1.0], "policy_versions": [0]}
    rollout["segments"].insert(0, env)
    answer = harness.submit(worker, rollout)
    assert answer.status_code == 422 and "env segments must not carry" in answer.json()["detail"]
    del env["logprobs"], env["policy_versions"]
    # A well-formed env segment the environment never produced fails the coordinator's replay.
    answer = harness.submit(worker, rollout)
    assert answer.status_code == 422 and "environment replay" in answer.json()["detail"]
    rollout["segments"].pop(0)
    assert harness.submit(worker, rollout).status_code == 200


def test_malformed_oversized_duplicate_and_stale(harness: Harness) -> None:
    worker = harness.register()
    harness.publish(0)
    lease = harness.lease(worker)
    rollout = harness.rollout(lease)
    before = harness.counts()
    headers = worker | {"Content-Type": "application/json"}
    answer = harness.client.post("/v1/rollouts", content=b'{"rollouts": [', headers=headers)
    assert answer.status_code == 422 and "not valid JSON" in answer.json()["detail"]
    answer = harness.client.post("/v1/rollouts", content=b'{"rollouts": [{"slot": -1}]}', headers=headers)
    assert answer.status_code == 422 and "rollouts.0.slot" in answer.json()["detail"]
    answer = harness.client.post("/v1/rollouts", content=b" " * 20_001, headers=headers)
    assert answer.status_code == 413 and "20000" in answer.json()["detail"]
    chunked = iter([b" " * 15_000, b" " * 15_000])  # no Content-Length: counted while reading
    answer = harness.client.post("/v1/rollouts", content=chunked, headers=headers)
    assert answer.status_code == 413 and "20000" in answer.json()["detail"]
    answer = harness.submit(worker, rollout, copy.deepcopy(rollout))
    assert answer.status_code == 409 and "appears twice" in answer.json()["detail"]
    harness.publish(1)
    harness.publish(2)
    answer = harness.submit(worker, rollout)
    assert answer.status_code == 409 and answer.json()["detail"].startswith("rollouts[0]: stale")
    assert {table: count for table, count in harness.counts().items() if table != "weights"} == {
        table: count for table, count in before.items() if table != "weights"
    }
    # the two oversized bodies were refused unread, each a second late (unsigned as far as anyone
    # knows: at most one such event a second is written, none charged to the worker)
    assert harness.rejections() == ["schema", "schema", "oversized", "oversized", "duplicate", "stale"]
    metrics = harness.client.get("/metrics").text
    assert 'decentrl_rollouts_rejected_total{reason="schema"} 2' in metrics


def test_filled_slot_and_foreign_lease(harness: Harness) -> None:
    alice, bob = harness.register("alice"), harness.register("bob")
    harness.publish(0)
    lease = harness.lease(alice)
    rollout = harness.rollout(lease)
    assert harness.submit(alice, rollout).status_code == 200
    answer = harness.submit(alice, rollout)
    assert answer.status_code == 409 and "already filled" in answer.json()["detail"]
    answer = harness.submit(bob, harness.rollout(lease, slot=1))
    assert answer.status_code == 403 and "another worker" in answer.json()["detail"]
    assert harness.query("SELECT COUNT(*) FROM rollouts") == [(1,)]


def test_expired_lease_slots_go_to_another_worker(harness: Harness) -> None:
    alice, bob = harness.register("alice"), harness.register("bob")
    harness.publish(0)
    lease = harness.lease(alice)
    assert harness.submit(alice, harness.rollout(lease, slot=0)).status_code == 200
    harness.clock.now += harness.config.coordinator.lease_seconds + 1
    late = harness.submit(alice, harness.rollout(lease, slot=1))
    assert late.status_code == 410 and "expired" in late.json()["detail"]
    second = harness.lease(bob)
    assert second["tasks"][0]["task_id"] == lease["tasks"][0]["task_id"]
    assert second["tasks"][0]["slots"] == [1]  # only the unfilled slot is re-leased
    answer = harness.submit(bob, harness.rollout(second, slot=0))
    assert answer.json()["groups_completed"] == 1
    assert harness.stats()["leases_expired"] == 1


def fill_groups(harness: Harness, worker: dict, count: int, version: int = 0) -> None:
    lease = harness.lease(worker, version=version, max_groups=count)
    assert len(lease["tasks"]) == count
    rollouts = [
        harness.rollout(lease, task, slot, version=version) for task in range(count) for slot in range(2)
    ]
    assert harness.submit(worker, *rollouts).json()["groups_completed"] == count


def test_trainer_batch_redelivery_and_ack(harness: Harness) -> None:
    worker = harness.register()
    harness.publish(0)
    fill_groups(harness, worker, 3)
    request = {"policy_version": 0, "max_groups": 2}
    first = harness.client.post("/v1/trainer/batches", json=request, headers=harness.trainer)
    assert first.status_code == 200
    batch = first.json()
    assert len(batch["groups"]) == 2 and [len(group["rollouts"]) for group in batch["groups"]] == [2, 2]
    assert {rollout["reward"] for group in batch["groups"] for rollout in group["rollouts"]} == {1.0}
    again = harness.client.post("/v1/trainer/batches", json=request, headers=harness.trainer)
    assert again.json() == batch  # un-acked: the same batch again
    answer = harness.client.post(
        f"/v1/trainer/batches/{batch['batch_id']}/ack", json={"policy_version": 1}, headers=harness.trainer
    )
    assert answer.status_code == 200
    states = dict(harness.query("SELECT state, COUNT(*) FROM tasks GROUP BY state"))
    assert states == {"trained": 2, "ready": 1}
    assert (
        harness.client.post("/v1/trainer/batches", json=request, headers=harness.trainer).status_code == 204
    )
    unknown = harness.client.post(
        "/v1/trainer/batches/b-nope/ack", json={"policy_version": 1}, headers=harness.trainer
    )
    assert unknown.status_code == 404
    assert harness.stats()["staleness"] == {"mean": 0.0, "histogram": {"0": 4}}


def test_an_ack_counts_the_workers_seen_in_the_last_minute(harness: Harness) -> None:
    """The trainer publishes catch-up patches only while some worker follows the weights."""
    worker = harness.register()
    harness.publish(0)
    fill_groups(harness, worker, 2)

    def ack_next() -> dict:
        request = {"policy_version": 0, "max_groups": 1}
        batch = harness.client.post("/v1/trainer/batches", json=request, headers=harness.trainer).json()
        path = f"/v1/trainer/batches/{batch['batch_id']}/ack"
        answer = harness.client.post(path, json={"policy_version": 1}, headers=harness.trainer)
        assert answer.status_code == 200
        return answer.json()

    assert ack_next()["workers_seen"] == 1  # it leased just now
    harness.clock.now += WORKERS_SEEN_S + 1
    assert ack_next()["workers_seen"] == 0


def test_a_held_batch_is_not_redelivered_and_every_unacked_one_comes_back_in_order(harness: Harness) -> None:
    """The trainer fetches its next batch while the last one's version is published (it names the
    batch it holds); a restarted trainer names none and gets every unacked batch back, oldest first."""
    worker = harness.register()
    harness.publish(0)
    fill_groups(harness, worker, 3)

    def take(held: list[str]) -> dict:
        request = {"policy_version": 0, "max_groups": 1, "held": held}
        answer = harness.client.post("/v1/trainer/batches", json=request, headers=harness.trainer)
        assert answer.status_code == 200
        return answer.json()

    first = take([])
    second = take([first["batch_id"]])
    assert second["batch_id"] != first["batch_id"]
    assert {g["group_id"] for g in second["groups"]}.isdisjoint(g["group_id"] for g in first["groups"])
    assert take([])["batch_id"] == first["batch_id"]  # a restart: the oldest unacked first
    assert take([first["batch_id"]])["batch_id"] == second["batch_id"]
    ack = harness.client.post(
        f"/v1/trainer/batches/{first['batch_id']}/ack", json={"policy_version": 1}, headers=harness.trainer
    )
    assert ack.status_code == 200
    assert take([])["batch_id"] == second["batch_id"]


def test_a_snapshot_on_demand_reaches_the_trainer_with_its_next_batch(harness: Harness) -> None:
    worker = harness.register()

    def ask(headers: dict):
        return harness.client.post("/v1/weights/snapshot-request", headers=headers)

    def flag() -> bool:
        request = {"policy_version": 1, "max_groups": 1}
        batch = harness.client.post("/v1/trainer/batches", json=request, headers=harness.trainer).json()
        return batch["snapshot_requested"]

    assert ask(worker).status_code == 409  # nothing published yet
    assert ask({}).status_code == 401
    harness.publish(0)
    assert ask(worker).json() == {"pending": False, "snapshot": 0, "next_at": None}  # the latest is one
    harness.publish(1)
    fill_groups(harness, worker, 1)
    assert flag() is False
    # A worker's ask waits for weights.min_snapshot_interval (8) versions after the newest snapshot.
    assert ask(worker).json() == {"pending": True, "snapshot": 0, "next_at": 8}
    assert flag() is False
    # The operator's (trainer token) is answered with the next version; one request, asked twice.
    assert ask(harness.trainer).json() == {"pending": True, "snapshot": 0, "next_at": 2}
    assert flag() is True  # the same (un-acked) batch now carries the request
    harness.publish(2)
    assert flag() is True  # a delta does not answer it
    harness.publish(2, kind="snapshot")  # what the trainer does: its next version as a snapshot too
    assert flag() is False
    assert ask(worker).json() == {"pending": False, "snapshot": 2, "next_at": None}


def test_workers_asking_for_snapshots_get_one_at_most_every_k_versions(harness: Harness) -> None:
    """Every worker asks after every version: snapshots still come only every
    weights.min_snapshot_interval versions, and a worker that keeps asking gets 429."""
    workers = [harness.register(f"w{i}") for i in range(3)]
    harness.publish(0)
    fill_groups(harness, workers[0], 1)
    snapshots = [0]
    for version in range(1, 25):
        answers = [harness.client.post("/v1/weights/snapshot-request", headers=w).json() for w in workers]
        assert all(answer["next_at"] in (None, snapshots[-1] + 8) for answer in answers), answers
        request = {"policy_version": version - 1, "max_groups": 1}
        batch = harness.client.post("/v1/trainer/batches", json=request, headers=harness.trainer).json()
        snapshot = batch["snapshot_requested"]
        harness.publish(version, kind="snapshot" if snapshot else None)
        if snapshot:
            snapshots.append(version)
    assert snapshots == [0, 8, 16, 24]
    for _ in range(60):
        status = harness.client.post("/v1/weights/snapshot-request", headers=workers[0]).status_code
    assert status == 429


def test_dynamic_sampling_skips_all_equal_groups_and_waits_for_others(harness: Harness) -> None:
    worker = harness.register()
    harness.publish(0)
    lease = harness.lease(worker, max_groups=3)
    # task 0: both right (all 1.0); task 1: both wrong (all 0.0); task 2: one of each
    outcomes = {0: (True, True), 1: (False, False), 2: (True, False)}
    rollouts = [harness.rollout(lease, t, s, correct=outcomes[t][s]) for t in range(3) for s in range(2)]
    assert harness.submit(worker, *rollouts).json()["groups_completed"] == 3
    request = {"policy_version": 0, "max_groups": 2, "drop_zero_variance": True}
    answer = harness.client.post("/v1/trainer/batches", json=request, headers=harness.trainer)
    assert answer.status_code == 204  # one informative group is not a batch of two: wait for more
    states = [state for (state,) in harness.query("SELECT state FROM tasks ORDER BY seq")]
    assert states == ["filtered", "filtered", "ready"]
    assert harness.stats()["groups_filtered"] == 2
    assert "decentrl_groups_filtered_total 2" in harness.client.get("/metrics").text
    # the two filtered groups no longer count against max_pending_groups: new tasks are leased
    refill = harness.lease(worker, max_groups=1)
    rollouts = [harness.rollout(refill, 0, s, correct=s == 0) for s in range(2)]
    harness.submit(worker, *rollouts)
    batch = harness.client.post("/v1/trainer/batches", json=request, headers=harness.trainer).json()
    rewards = [sorted(r["reward"] for r in group["rollouts"]) for group in batch["groups"]]
    assert rewards == [[0.0, 1.0], [0.0, 1.0]]


def test_an_alarm_fires_when_dynamic_sampling_drops_nearly_every_group(
    tmp_path: Path, model_dir: Path, store: str
) -> None:
    monitors = {"max_filtered_fraction": 0.75, "filtered_min_groups": 5}
    harness = Harness(tmp_path / "run", model_dir, reward={"monitors": monitors}, store=store)
    try:
        worker = harness.register()
        harness.publish(0)
        lease = harness.lease(worker, max_groups=5)
        # four groups all right (every reward 1.0), one group right and wrong
        rollouts = [harness.rollout(lease, t, s, correct=t < 4 or s == 0) for t in range(5) for s in range(2)]
        assert harness.submit(worker, *rollouts).json()["groups_completed"] == 5
        request = {"policy_version": 0, "max_groups": 1, "drop_zero_variance": True}
        batch = harness.client.post("/v1/trainer/batches", json=request, headers=harness.trainer)
        assert batch.status_code == 200 and len(batch.json()["groups"]) == 1
        assert harness.stats()["groups_filtered"] == 4
        step = {"policy_version": 1, "metrics": {"reward_mean": 0.5}}
        answer = harness.client.post("/v1/trainer/metrics", json=step, headers=harness.trainer)
        # 4 of the 5 groups that finished were dropped: 80 % >= 75 %
        assert answer.json()["alarms"] == [
            "groups_filtered: dynamic sampling dropped 4 of the last 5 groups (80%): their rewards were all equal"
        ]
        assert harness.stats()["reward"]["alarms"] == {"groups_filtered": 1}
        assert (
            'decentrl_reward_alarms_total{alarm="groups_filtered"} 1' in harness.client.get("/metrics").text
        )
    finally:
        harness.stop()


def test_stale_groups_expire_at_batch_time(harness: Harness) -> None:
    worker = harness.register()
    harness.publish(0)
    fill_groups(harness, worker, 1, version=0)
    harness.publish(1)
    fill_groups(harness, worker, 1, version=1)
    harness.publish(2)
    request = {"policy_version": 2, "max_groups": 2}
    answer = harness.client.post("/v1/trainer/batches", json=request, headers=harness.trainer)
    assert answer.status_code == 204  # the v0 group expired, one ready group is not enough
    assert harness.query("SELECT state FROM tasks ORDER BY seq") == [("expired",), ("ready",)]
    fill_groups(harness, worker, 1, version=2)
    batch = harness.client.post("/v1/trainer/batches", json=request, headers=harness.trainer).json()
    assert batch["num_groups_expired"] == 1 and len(batch["groups"]) == 2
    assert harness.stats()["groups_expired"] == 1
    assert "decentrl_groups_expired_total 1" in harness.client.get("/metrics").text


def test_weights_publish_fetch_idempotency_and_prune(harness: Harness) -> None:
    """Manifest checks on the coordinator; the worker-side path is tests/integration/test_weights_*."""
    from decentrl.weights.manifest import Manifest
    from decentrl.weights.signing import load_or_create_key, sign

    client, trainer = harness.client, harness.trainer
    assert client.get("/v1/weights/latest", headers=trainer).status_code == 404
    body = b"\x00payload bytes"
    digest = hashlib.sha256(body).hexdigest()
    answer = client.put(f"/v1/weights/chunks/{'0' * 64}", content=body, headers=trainer)
    assert answer.status_code == 422 and "hash" in answer.json()["detail"]
    info = harness.publish(0, body)
    assert info["num_bytes"] == len(body) and harness.publish(0, body) == info  # idempotent
    worker = harness.register()
    manifest = Manifest.model_validate_json(
        client.get("/v1/weights/manifests/0/snapshot", headers=worker).content
    )
    assert client.get(f"/v1/weights/chunks/{digest}", headers=worker).content == body
    assert client.get(f"/v1/weights/chunks/{digest}").status_code == 401
    # A manifest signed by any other key, or a delta that does not extend v0, is refused.
    forged = sign(
        manifest.model_copy(
            update={"version": 1, "kind": "delta", "parent": 0, "parent_state_sha256": manifest.state_sha256}
        ),
        load_or_create_key(harness.run_dir.parent / "other.pem"),
    )
    answer = client.put("/v1/weights/manifests/1/delta", content=forged.model_dump_json(), headers=trainer)
    assert answer.status_code == 422 and "not signed by the trainer" in answer.json()["detail"]
    harness.state_hashes[0] = "1" * 64
    with pytest.raises(AssertionError, match="does not apply"):
        harness.publish(1)
    harness.state_hashes[0] = manifest.state_sha256
    with pytest.raises(AssertionError, match="next version must be 1"):
        harness.publish(5, kind="snapshot")
    for version in range(1, 80):
        harness.publish(version, kind="snapshot" if version % 20 == 0 else None)
    index = client.get("/v1/weights/index", headers=worker).json()
    # The newest 64 versions (16..79) and the newest snapshot at or before 16 (0) stay reachable.
    assert client.get("/v1/weights/latest", headers=worker).json()["version"] == 79
    assert min(entry["version"] for entry in index) == 0
    for version in range(80, 101):
        harness.publish(version, kind="snapshot" if version % 20 == 0 else None)
    index = client.get("/v1/weights/index", headers=worker).json()
    assert min(entry["version"] for entry in index) == 20  # newest snapshot at or before 100 - 63
    assert client.get("/v1/weights/manifests/5/delta", headers=worker).status_code == 410
    assert client.get("/v1/weights/manifests/101/delta", headers=worker).status_code == 404
    stored = {p.name for p in (harness.run_dir / "weights" / "chunks").glob("*/*")}  # pruned chunks go
    assert hashlib.sha256(b"weights 5").hexdigest() not in stored
    assert hashlib.sha256(b"weights 20").hexdigest() in stored


def test_model_files_whitelist(harness: Harness) -> None:
    worker = harness.register()
    answer = harness.client.get("/v1/model/files/tokenizer.json", headers=worker)
    assert answer.status_code == 200 and answer.content == (harness.model_dir / "tokenizer.json").read_bytes()
    for name in ("model.safetensors", "..%2F..%2Frun%2Ftokens.json", "%2Fetc%2Fpasswd"):
        assert harness.client.get(f"/v1/model/files/{name}", headers=worker).status_code == 404
    info = harness.client.get("/v1/info", headers=worker).json()
    assert "model.safetensors" not in info["model_files"] and "config.json" in info["model_files"]


PROMETHEUS_LINE = re.compile(
    r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_]\w*="([^"\\]|\\.)*",?)*\})? (NaN|[+-]Inf|[-+0-9.e]+)$'
)


def test_metrics_text_and_trainer_history(harness: Harness) -> None:
    worker = harness.register()
    harness.publish(0)
    fill_groups(harness, worker, 1)
    step = {"policy_version": 1, "metrics": {"loss": 0.25, "reward/mean": 0.5}}
    assert harness.client.post("/v1/trainer/metrics", json=step, headers=harness.trainer).status_code == 200
    text = harness.client.get("/metrics").text
    families = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            families.add(line.split()[2])
        elif not line.startswith("# HELP "):
            assert PROMETHEUS_LINE.match(line), line
            name = re.split(r"[{ ]", line)[0]
            # each sample follows its TYPE line (a histogram's samples carry _bucket/_sum/_count)
            assert name in families or re.sub(r"_(bucket|sum|count)$", "", name) in families, line
    for name in ("decentrl_rollouts_accepted_total", "decentrl_workers", "decentrl_mean_staleness"):
        assert name in families
    # the batch was never issued, so no rollout has a training staleness yet: an empty histogram
    assert 'decentrl_rollout_staleness_bucket{le="+Inf"} 0' in text
    assert "decentrl_rollouts_accepted_total 2" in text and "decentrl_tokens_accepted_total" in text
    assert "decentrl_trainer_reward_mean 0.5" in text and 'decentrl_groups{state="ready"} 1' in text
    assert harness.stats()["history"] == [step]


def test_restart_keeps_tokens_leases_rollouts_and_versions(harness: Harness) -> None:
    worker = harness.register()
    harness.publish(0)
    lease = harness.lease(worker)
    assert harness.submit(worker, harness.rollout(lease, slot=0)).status_code == 200
    tokens = (harness.run_dir / "tokens.json").read_text()
    harness.stop()
    harness.start()
    assert (harness.run_dir / "tokens.json").read_text() == tokens
    assert harness.client.get("/v1/weights/latest", headers=worker).json()["version"] == 0
    answer = harness.submit(worker, harness.rollout(lease, slot=1))  # the lease survived the restart
    assert answer.status_code == 200 and answer.json()["groups_completed"] == 1
    assert harness.stats()["rollouts_accepted"] == 2
    assert harness.lease(worker)["tasks"][0]["task_id"] != lease["tasks"][0]["task_id"]


def test_serve_announces_and_stops_on_sigterm(tmp_path: Path, model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    script = (
        "import sys; from pathlib import Path; from decentrl.config import RunConfig, CoordinatorConfig;"
        "from decentrl.coordinator.server import serve;"
        "serve(RunConfig(coordinator=CoordinatorConfig(port=0)), Path(sys.argv[1]), Path(sys.argv[2]))"
    )
    process = subprocess.Popen([sys.executable, "-c", script, str(run_dir), str(model_dir)])
    try:
        announce = run_dir / "coordinator.json"
        deadline = time.time() + 30
        while not announce.exists() and time.time() < deadline:
            time.sleep(0.05)
        info = json.loads(announce.read_text())
        assert info["pid"] == process.pid and oct(announce.stat().st_mode & 0o777) == "0o600"
        import httpx

        assert httpx.get(f"{info['url']}/v1/health", timeout=5).json()["status"] == "ok"
        headers = {"Authorization": f"Bearer {info['trainer_token']}"}
        assert httpx.get(f"{info['url']}/v1/info", headers=headers, timeout=5).status_code == 200
    finally:
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    assert not announce.exists()


def test_openapi_declares_every_request_body(harness: Harness) -> None:
    """Routes parse their bodies themselves; /openapi.json still says what each one takes."""
    schema = harness.client.get("/openapi.json").json()
    bodiless = {("post", "/v1/workers/challenge"), ("post", "/v1/weights/snapshot-request")}
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            if method in ("post", "put") and (method, path) not in bodiless:
                assert "requestBody" in operation, f"{method.upper()} {path} declares no request body"
    components = schema["components"]["schemas"]
    submission = schema["paths"]["/v1/rollouts"]["post"]["requestBody"]["content"]["application/json"]
    assert submission["schema"] == {"$ref": "#/components/schemas/RolloutSubmission"}
    assert "rollouts" in components["RolloutSubmission"]["properties"]
    chunk = schema["paths"]["/v1/weights/chunks/{digest}"]["put"]["requestBody"]["content"]
    assert chunk == {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
    references = re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(schema))
    assert set(references) <= set(components), set(references) - set(components)


def test_a_waiting_lease_is_granted_when_an_ack_frees_room(tmp_path: Path, model_dir: Path) -> None:
    """Long poll: with the untrained groups at max_pending_groups, a lease request that may wait is
    answered as soon as the trainer's ack frees room, and with 204 once its wait is over."""
    harness = Harness(tmp_path / "run", model_dir, max_pending_groups=1)
    try:
        worker = harness.register()
        harness.publish(0)
        fill_groups(harness, worker, 1)
        request = {"policy_version": 0, "max_groups": 1, "wait_seconds": 0.5}
        started = time.monotonic()
        answer = harness.client.post("/v1/leases", json=request, headers=worker)
        assert answer.status_code == 204 and time.monotonic() - started >= 0.5
        batch = harness.client.post(
            "/v1/trainer/batches", json={"policy_version": 0, "max_groups": 1}, headers=harness.trainer
        ).json()
        with ThreadPoolExecutor(1) as pool:
            started = time.monotonic()
            waiting = pool.submit(
                harness.client.post, "/v1/leases", json=request | {"wait_seconds": 5.0}, headers=worker
            )
            time.sleep(0.3)
            assert not waiting.done()
            ack = harness.client.post(
                f"/v1/trainer/batches/{batch['batch_id']}/ack",
                json={"policy_version": 1},
                headers=harness.trainer,
            )
            assert ack.status_code == 200
            answer = waiting.result(10)
            assert answer.status_code == 200 and len(answer.json()["tasks"]) == 1
            assert 0.3 <= time.monotonic() - started < 3.0
    finally:
        harness.stop()


def test_a_waiting_batch_request_is_answered_when_its_last_group_is_scored(harness: Harness) -> None:
    worker = harness.register()
    harness.publish(0)
    lease = harness.lease(worker, max_groups=1)
    request = {"policy_version": 0, "max_groups": 1, "wait_seconds": 5.0}
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        waiting = pool.submit(
            harness.client.post, "/v1/trainer/batches", json=request, headers=harness.trainer
        )
        time.sleep(0.3)
        assert not waiting.done()
        harness.submit(worker, harness.rollout(lease, slot=0), harness.rollout(lease, slot=1), settle=False)
        answer = waiting.result(10)
        assert answer.status_code == 200 and len(answer.json()["groups"]) == 1
        assert time.monotonic() - started < 4.0
