"""A real coordinator process on loopback with a trusted side (publisher, verifier, a draining
trainer) and a factory of worker identities: the stage of the adversarial suite and benchmark.

Hostile workers are real clients: each registers its own Ed25519 key with the enrollment token and
speaks the wire protocol through `CoordinatorClient`. Honest work is played by the worker's own
`Player` on one engine (`hf`, or `vllm` in a chosen dtype) holding exactly the published
(verified, reconstructed) weights; every identity declares that engine class at registration. The
trainer here does not train: it publishes a few versions up front (the warm start plus small
perturbations, so that versions differ) and acknowledges ready groups, which keeps leases flowing.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sqlite3
import tempfile
import threading
import time
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from decentrl.client import CoordinatorClient, CoordinatorUnavailable, RequestRejected
from decentrl.config import DEMO_CONFIG, load_config
from decentrl.engines.base import InferenceEngine
from decentrl.engines.hf import HFEngine
from decentrl.envs.chat import ChatFormat
from decentrl.envs.player import Player, lease_seed
from decentrl.launch.local import Role, wait_for_coordinator
from decentrl.model.precision import Precision
from decentrl.model.vision import PixelInputs, load_policy
from decentrl.protocol import (
    BatchAck,
    BatchRequest,
    Lease,
    LeaseRequest,
    RegisterRequest,
    Rollout,
    SamplingParams,
)
from decentrl.trust.identity import Signer
from decentrl.verifier.main import Verifier, policy_state
from decentrl.weights.publisher import Publisher

log = logging.getLogger(__name__)

PERTURBATION = 0.02
"""Relative noise that makes each published version differ from the last (log-probs move ~0.1)."""


class Agent:
    """One worker identity: its own key, registration and signed client."""

    def __init__(self, arena: Arena, name: str, dtype: str | None = None):
        """`dtype`: the one it declares, if not the arena engine's (a worker lying about its class)."""
        self.arena = arena
        self.signer = Signer(Ed25519PrivateKey.generate())
        self.client = CoordinatorClient(arena.url, max_wait=30)
        self.client.signer = self.signer
        request = RegisterRequest(
            name=name,
            engine=arena.engine_name,
            dtype=dtype or arena.dtype,  # pyright: ignore[reportArgumentType]
            device="cpu",
            public_key=self.signer.public_key,
        )
        answer = self.client.register(request, arena.enroll_token)
        self.worker_id, self.client.token = answer.worker_id, answer.token
        self.submissions = 0
        self.lease_groups = 1
        """Groups per lease when it measures its rate (`outsiders.honest_rate`)."""

    def lease(self, max_groups: int) -> Lease:
        lease = None
        while lease is None:
            lease = self.client.lease(LeaseRequest(policy_version=self.arena.latest, max_groups=max_groups))
            if lease is None:
                time.sleep(0.05)
        return lease

    def play(self, lease: Lease, version: int | None = None) -> list[Rollout]:
        """Honest rollouts of the lease, sampled at `version` (default: the latest)."""
        return self.arena.play(lease, self.arena.latest if version is None else version)

    def close(self) -> None:
        self.client.close()


class Arena:
    def __init__(
        self,
        model_dir: Path,
        run_dir: Path,
        overrides: list[str],
        num_versions: int = 6,
        engine: str = "hf",
        dtype: str = "float32",
        config_path: Path = DEMO_CONFIG,
    ):
        """`engine` and `dtype`: what every identity samples with (`hf` computes in float32; `vllm`
        in `dtype`, from .venv-vllm) and declares at registration. `config_path`: the run's
        config (its task, sampling and trust settings; the model is `model_dir`)."""
        self.model_dir, self.run_dir = model_dir, run_dir
        self.engine_name, self.dtype = engine, "float32" if engine == "hf" else dtype
        self.config = load_config(config_path, overrides)
        run_dir.mkdir(parents=True, exist_ok=True)
        config_path = run_dir / "config.json"
        config_path.write_text(self.config.model_dump_json())
        args = ["coordinator", "--config", str(config_path), "--run-dir", str(run_dir)]
        self.coordinator = Role("coordinator", [*args, "--model-dir", str(model_dir), "--port", "0"], run_dir)
        try:
            self._start(run_dir, num_versions)
        except BaseException:
            self.coordinator.stop()  # never leave an orphaned coordinator behind
            raise

    def _start(self, run_dir: Path, num_versions: int) -> None:
        endpoint = wait_for_coordinator(run_dir, self.coordinator)
        self.url, self.enroll_token = endpoint["url"], endpoint["enroll_token"]
        self.trainer_token = endpoint["trainer_token"]
        self.trainer = CoordinatorClient(self.url, self.trainer_token, max_wait=60)
        self.cache = Path(tempfile.mkdtemp(prefix="arena-chunks-"))
        self._publish(num_versions)
        info = self.trainer.info()
        self.engine = self._engine(info.eos_token_ids, info.pad_token_id)
        self._scorer: torch.nn.Module | None = None
        self.states = {v: policy_state(self.trainer, v, self.cache) for v in range(num_versions)}
        self.player = Player(ChatFormat.from_model_dir(self.model_dir, info.eos_token_ids), info.env_args)
        if self.engine_name != "hf":  # vLLM's first generation warms up for seconds: not inside a lease
            self.engine.load_weights(self.states[self.latest], self.latest)
            self.engine.generate([[info.eos_token_ids[0]]] * 64, SamplingParams(max_new_tokens=6), seed=0)
        self.stop = threading.Event()
        self.verifier = Verifier(
            CoordinatorClient(self.url, self.trainer_token, max_wait=60),
            self.model_dir,
            self.cache,
            Precision(torch.device("cpu"), torch.float32),
        )
        self.threads = [
            threading.Thread(target=self._verify, name="verifier", daemon=True),
            threading.Thread(target=self._drain, name="drain", daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def _engine(self, eos_token_ids: list[int], pad_token_id: int) -> InferenceEngine:
        if self.engine_name == "vllm":
            from decentrl.engines.vllm import VLLMEngine

            return VLLMEngine(self.model_dir, dtype=self.dtype)
        model = load_policy(self.model_dir, torch.float32)
        pixels = PixelInputs.from_model_dir(self.model_dir)  # a vision-language model's images
        return HFEngine(model, eos_token_ids, pad_token_id, device="cpu", pixels=pixels)

    def _publish(self, num_versions: int) -> None:
        publisher = Publisher(self.trainer, self.config.weights, self.run_dir / "trainer_key.pem")
        publisher.register()
        model = load_policy(self.model_dir, torch.float32)
        generator = torch.Generator().manual_seed(0)
        for version in range(num_versions):
            if version:
                model = copy.deepcopy(model)  # the publisher may keep the last state without a copy
                with torch.no_grad():
                    for tensor in model.parameters():
                        noise = torch.randn(tensor.shape, generator=generator)
                        tensor.add_(PERTURBATION * tensor.std() * noise)
            publisher.publish(model, version)
        self.latest = num_versions - 1

    def _verify(self) -> None:
        with contextlib.suppress(CoordinatorUnavailable):  # the coordinator stopped first
            self.verifier.run(self.stop)

    def _drain(self) -> None:
        """The non-training trainer: acknowledge every ready group so leases keep flowing."""
        request = BatchRequest(policy_version=self.latest, max_groups=1)
        while not self.stop.is_set():
            try:
                batch = self.trainer.next_batch(request)
            except (CoordinatorUnavailable, RequestRejected):
                return
            if batch is None:
                self.stop.wait(0.05)
                continue
            self.trainer.ack_batch(batch.batch_id, BatchAck(policy_version=self.latest))

    def play(self, lease: Lease, version: int) -> list[Rollout]:
        if self.engine.policy_version != version:
            self.engine.load_weights(self.states[version], version)
        return self.player.play(self.engine, lease, lease_seed(lease.lease_id))

    def tolerance(self) -> tuple[str, dict]:
        """The tolerance table key and entry the arena's identities are held to (from `/v1/info`)."""
        from decentrl.trust.logprob_tolerance import LogprobTolerance, ToleranceTable

        table = {k: LogprobTolerance(**v) for k, v in self.trainer.info().logprob_tolerances.items()}
        loosest = self.config.trust.loosest_tolerance
        key, entry = ToleranceTable(table, loosest).lookup(self.engine_name, self.dtype, "cpu")
        return key, entry.model_dump()

    def scorer(self) -> torch.nn.Module:
        """A float32 transformers model on the latest version (what a writer computes its answers'
        log-probs with, whatever engine samples)."""
        if self._scorer is None:
            self._scorer = load_policy(self.model_dir, torch.float32).eval()
            self._scorer.load_state_dict(self.states[self.latest], strict=False)
        return self._scorer

    def agent(self, name: str, dtype: str | None = None) -> Agent:
        return Agent(self, name, dtype)

    def settle(self, timeout: float = 60.0) -> None:
        """Wait until every verification job has its verdict."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            jobs = self.trainer.stats()["trust"]["jobs"]
            if jobs["pending"] == 0 and jobs["claimed"] == 0:
                return
            time.sleep(0.02)
        raise TimeoutError("the verifier did not keep up")

    def query(self, sql: str, *args: object) -> list[tuple]:
        with sqlite3.connect(self.run_dir / "coordinator.db", timeout=30) as db:
            return db.execute(sql, args).fetchall()

    def _count(self, worker_id: str, leases: list[str] | None, states: tuple[str, ...] | None) -> int:
        sql = "SELECT COUNT(*) FROM rollouts r JOIN tasks t ON t.task_id = r.task_id WHERE r.worker_id = ?"
        args: list[object] = [worker_id]
        if states is not None:
            sql += f" AND t.state IN ({', '.join('?' * len(states))})"
            args += states
        if leases is not None:
            sql += f" AND r.lease_id IN ({', '.join('?' * len(leases))})"
            args += leases
        return self.query(sql, *args)[0][0] if leases != [] else 0

    def stored(self, worker_id: str, leases: list[str] | None = None) -> int:
        """Rollouts of `worker_id` (answering one of `leases`, if given) in the store: trained, or
        kept for training (a quarantine discards the untrained ones)."""
        return self._count(worker_id, leases, None)

    def trained(self, worker_id: str, leases: list[str] | None = None) -> int:
        """Rollouts of `worker_id` (answering one of `leases`, if given) that reached a trainer batch."""
        return self._count(worker_id, leases, ("batched", "trained"))

    def quarantined(self, worker_id: str) -> str | None:
        rows = self.query(
            "SELECT reason FROM reputation WHERE worker_id = ? AND quarantined IS NOT NULL", worker_id
        )
        return rows[0][0] if rows else None

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)
        self.trainer.close()
        self.coordinator.stop()
