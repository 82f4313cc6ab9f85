"""Workers on the vllm and openai engines through the real coordinator -> trainer -> verifier loop
(processes on loopback, the BPE model): versions advance into the live engines, every rollout is
trained on, and the verifier, recomputing log-probs with the trainer's code, finds the engines'
log-probs honest."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from vllm_support import require_vllm

from decentrl.client import CoordinatorClient
from decentrl.config import load_config
from decentrl.launch.local import Role, wait_for_coordinator

require_vllm()
pytestmark = [pytest.mark.vllm, pytest.mark.integration]


def write_config(run_dir: Path, *overrides: str) -> Path:
    config = load_config(
        None,
        [
            "trainer.num_steps=3",
            "trainer.groups_per_step=2",
            "trainer.minibatches_per_version=1",
            "trainer.eval_every=0",
            "coordinator.group_size=4",
            "coordinator.max_pending_groups=6",
            "coordinator.max_new_tokens=8",
            "worker.groups_per_lease=2",
            "trust.verify_fraction=1.0",  # every rollout's log-probs recomputed by the verifier
            "lora.rank=0",
            "algorithm.entropy_coef=0.01",  # random weights earn no reward: make every step move them
            *overrides,
        ],
    )
    path = run_dir / "config.json"
    path.write_text(config.model_dump_json())
    return path


def role(name: str, run_dir: Path, *args: str) -> Role:
    return Role(name, [name.split("-")[0], *args], run_dir, python=sys.executable)


@pytest.mark.parametrize(
    ("engine", "lora_rank"),
    # a LoRA run serves its adapters unmerged on the vllm engine; the verifier recomputes them so
    # (CI time: the full-parameter vllm run is `make test-all`'s; openai-0 runs that path through a
    # vLLM server and vllm-2 the in-process engine)
    [pytest.param("vllm", 0, marks=pytest.mark.slow), ("openai", 0), ("vllm", 2)],
)
def test_a_worker_on_the_engine_trains_the_model_and_passes_verification(
    tmp_path, bpe_model, request, engine, lora_rank
):
    extra = [f"worker.openai_url={request.getfixturevalue('vllm_server').url}"] if engine == "openai" else []
    config = write_config(tmp_path, f'worker.engine="{engine}"', f"lora.rank={lora_rank}", *extra)
    common = ["--config", str(config)]
    model = ["--model-dir", str(bpe_model.model_dir)]
    coordinator = role("coordinator", tmp_path, *common, *model, "--run-dir", str(tmp_path), "--port", "0")
    roles = [coordinator]
    try:
        endpoint = wait_for_coordinator(tmp_path, coordinator)
        at = ["--coordinator", endpoint["url"], f"--token={endpoint['trainer_token']}"]
        trainer = role("trainer", tmp_path, *common, *at, *model, "--run-dir", str(tmp_path))
        verifier = role("verifier", tmp_path, *common, *at, *model)
        worker = role(
            "worker-0",
            tmp_path,
            *common,
            "--coordinator",
            endpoint["url"],
            f"--token={endpoint['enroll_token']}",
            "--name",
            "worker-0",
            "--state-dir",
            str(tmp_path / "worker-0"),
        )
        roles += [trainer, verifier, worker]
        trainer.process.wait(timeout=900)
        logs = "\n".join(f"--- {r.name}\n{r.log_path.read_text()[-2500:]}" for r in roles)
        assert trainer.process.returncode == 0, logs
        with CoordinatorClient(endpoint["url"], endpoint["trainer_token"], max_wait=30) as client:
            stats = client.stats()
        assert stats["latest_version"] == 3, logs
        assert all(h["metrics"]["num_rollouts"] == 8 for h in stats["history"])
        trust = stats["trust"]
        assert trust["workers_quarantined"] == 0, trust
        (record,) = trust["workers"].values()
        assert record["verified"] > 0 and record["logprob_failures"] == 0, record
        assert f"engine {engine}" in worker.log_path.read_text()
    finally:
        for r in reversed(roles):
            r.stop()
