"""A worker process against the real coordinator process on loopback, with the tiny model.

Covers the worker's whole life: register, fetch model files and weights, serve leases, follow a
new version, ride out a coordinator restart with the same credentials, and exit 0 on SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from decentrl.client import CoordinatorClient
from decentrl.config import ModelConfig, RunConfig, WorkerConfig

pytestmark = pytest.mark.integration

COORDINATOR = (
    "import sys, pathlib; from decentrl.config import RunConfig; from decentrl.coordinator.server import serve; "
    "serve(RunConfig.model_validate_json(sys.argv[1]), pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3]))"
)
WORKER = (
    "import faulthandler, sys; faulthandler.dump_traceback_later(120); "
    "from decentrl.config import WorkerConfig; from decentrl.worker import main_worker; "
    "sys.exit(main_worker(WorkerConfig.model_validate_json(sys.argv[1])))"
)


def perturbed(model, seed: int):
    """The model with every weight moved a little (a new policy version)."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    return model


def wait_for(condition, what: str, log: Path, timeout: float = 180.0) -> None:
    """Generous timeout: on two busy cores, importing torch + transformers alone can take a minute."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}; log:\n{log.read_text()}"
        time.sleep(0.1)


def start(code: str, *args: str, log: Path) -> subprocess.Popen:
    with log.open("a") as file:
        return subprocess.Popen(
            [sys.executable, "-c", code, *args],
            stdout=file,
            stderr=subprocess.STDOUT,
            env=os.environ | {"PYTHONUNBUFFERED": "1"},
        )


def stop(process: subprocess.Popen, timeout: float = 60) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout)
    finally:
        process.kill()


@pytest.mark.slow  # 33 s; in CI the loop tests run real workers against a real coordinator, and
# test_coordinator_sigkilled_mid_run_restarts_and_loses_nothing has them ride out a restart
def test_worker_against_real_coordinator(tmp_path):
    pytest.importorskip("decentrl.coordinator.server", reason="the coordinator is not written yet")
    from decentrl.model.tiny import build_tiny, save_model_dir

    model_config = ModelConfig(hidden_size=64, num_heads=2, intermediate_size=64)
    model, tokenizer = build_tiny(model_config)
    model_dir = save_model_dir(model, tokenizer, tmp_path / "model")
    run = RunConfig(model=model_config)
    run.coordinator.port = 0
    run.coordinator.group_size = 4
    run_dir = tmp_path / "run"
    announce = run_dir / "coordinator.json"
    coordinator_log, worker_log = tmp_path / "coordinator.log", tmp_path / "worker.log"

    coordinator = start(COORDINATOR, run.model_dump_json(), str(run_dir), str(model_dir), log=coordinator_log)
    worker = None
    try:
        wait_for(announce.is_file, "the coordinator's announce file", coordinator_log)
        announced = json.loads(announce.read_text())
        url = announced["url"]
        trainer = CoordinatorClient(url, announced["trainer_token"], max_wait=30)
        from decentrl.weights.publisher import Publisher

        publisher = Publisher(trainer, run.weights, tmp_path / "trainer" / "signing_key.pem")
        publisher.register()
        publisher.publish(perturbed(model, 0), 0)

        config = WorkerConfig(
            coordinator_url=url,
            token=announced["enroll_token"],
            name="it-worker",
            state_dir=str(tmp_path / "worker"),
            groups_per_lease=2,
        )
        worker = start(WORKER, config.model_dump_json(), log=worker_log)
        wait_for(lambda: trainer.stats()["rollouts_accepted"] >= 8, "the first rollouts", worker_log)

        publisher.publish(perturbed(model, 1), 1)
        wait_for(lambda: "loaded weights v1" in worker_log.read_text(), "version 1 on the worker", worker_log)
        accepted = trainer.stats()["rollouts_accepted"]
        wait_for(lambda: trainer.stats()["rollouts_accepted"] > accepted, "rollouts at version 1", worker_log)
        assert trainer.stats()["rollouts_rejected"]["total"] == 0, worker_log.read_text()

        # Restart the coordinator on the same port: the worker retries, then carries on as itself.
        assert stop(coordinator) == 0
        time.sleep(1.0)
        run.coordinator.port = int(url.rsplit(":", 1)[1])
        coordinator = start(
            COORDINATOR, run.model_dump_json(), str(run_dir), str(model_dir), log=coordinator_log
        )
        accepted = trainer.stats()["rollouts_accepted"]
        wait_for(
            lambda: trainer.stats()["rollouts_accepted"] > accepted + 8, "rollouts after restart", worker_log
        )

        # Its token is replaced mid-run (its key registered again, as a second start on the same
        # key would): the requests in flight are refused, it registers again once, keeps its
        # identity, and the refused work is sent again and accepted.
        from decentrl.protocol import RegisterRequest
        from decentrl.trust.identity import Signer, load_or_create_worker_key

        saved = json.loads((tmp_path / "worker" / "credentials.json").read_text())
        with CoordinatorClient(url, max_wait=30) as thief:
            thief.signer = Signer(load_or_create_worker_key(tmp_path / "worker"))
            request = RegisterRequest(name="it-worker", public_key=thief.signer.public_key)
            taken = thief.register(request, announced["enroll_token"])
        assert taken.worker_id == saved["worker_id"] and taken.token != saved["token"]
        accepted = trainer.stats()["rollouts_accepted"]
        wait_for(
            lambda: worker_log.read_text().count("registered as") == 2, "a second registration", worker_log
        )
        wait_for(
            lambda: trainer.stats()["rollouts_accepted"] > accepted + 8, "rollouts after renewal", worker_log
        )
        renewed = json.loads((tmp_path / "worker" / "credentials.json").read_text())
        assert renewed["worker_id"] == saved["worker_id"] and renewed["token"] not in (
            saved["token"],
            taken.token,
        )
        rejected = trainer.stats()["rollouts_rejected"]["by_reason"]
        assert set(rejected) == {"auth"} and rejected["auth"] <= 3, rejected  # the requests in flight
        assert "rejected" not in worker_log.read_text().split("registering again")[-1], worker_log.read_text()
        assert worker.poll() is None

        # no token and no saved credentials against a permissioned coordinator: one line, exit 2
        tokenless = subprocess.run(
            [
                sys.executable,
                "-m",
                "decentrl",
                "worker",
                "--coordinator",
                url,
                "--state-dir",
                str(tmp_path / "x"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert tokenless.returncode == 2, tokenless.stderr
        assert "--token" in tokenless.stderr.strip().splitlines()[-1]

        assert stop(worker) == 0
        log = worker_log.read_text()
        assert log.count("registered as") == 2 and log.count("registering again") == 1, log
        assert "rejections {}" in log.split("stopped:")[-1], log  # each refused request sent again
        assert "finishing the current step" in log and "stopped:" in log, log
        assert "retry" in log, log  # the restart was ridden out by the client's retries
    finally:
        if worker is not None:
            worker.kill()
        stop(coordinator)
