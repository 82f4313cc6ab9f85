"""The roles started by hand, one command each, as docs/operations.md has a newcomer do it: the
run says what it waits on, whom it misses, and when it is over."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import httpx
import pytest
from test_loop import model_dir, start_system, start_trainer, start_worker, wait_until, write_config

from decentrl.client import CoordinatorClient
from decentrl.config import load_config
from decentrl.launch.local import Role

pytestmark = pytest.mark.integration

__all__ = ["model_dir"]  # the module's fixture, shared


def start_verifier(run_dir, model_dir, config, endpoint: dict) -> Role:
    args = ["verifier", "--config", str(config), "--coordinator", endpoint["url"]]
    args += [f"--token={endpoint['trainer_token']}", "--model-dir", str(model_dir)]
    return Role("verifier", args, run_dir)


def overview(endpoint: dict) -> dict:
    page, token = endpoint["dashboard_url"].split("#token=")
    answer = httpx.get(f"{page}/api/overview", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    return answer.raise_for_status().json()


def test_a_run_by_hand_says_what_it_waits_for_keeps_its_directory_and_ends(tmp_path, model_dir):
    config = write_config(tmp_path, "trust.verify_fraction=1.0")
    coordinator, endpoint = start_system(tmp_path, model_dir, config)
    roles = [coordinator]
    try:
        # a setting given to the trainer alone, which the run directory must keep all the same
        trainer = start_trainer(tmp_path, model_dir, config, endpoint, "--set", "trainer.num_steps=3")
        roles += [trainer, start_worker("worker-0", tmp_path, config, endpoint)]
        with CoordinatorClient(endpoint["url"], endpoint["trainer_token"], max_wait=30) as client:
            wait_until(lambda: client.stats()["trust"]["jobs"]["pending"] > 0, "a verify job", roles)
            pending_at = time.monotonic()

            def everyone_says_so() -> bool:
                said = "waiting for a verifier"
                waiting = overview(endpoint)["run"]["waiting_for"]
                return (
                    said in coordinator.log_path.read_text()
                    and said in trainer.log_path.read_text()
                    and [entry["role"] for entry in waiting] == ["verifier"]
                )

            wait_until(everyone_says_so, "the run to say it waits for a verifier", roles, timeout=60)
            assert time.monotonic() - pending_at < 60
            run = client.stats()["run"]
        assert run["state"] == "waiting" and run["connected"]["verifier"] is False
        assert run["connected"]["trainer"] is True
        (entry,) = run["waiting_for"]
        assert entry["command"] == f"decentrl verifier --coordinator {endpoint['url']} --token=TRAINER_TOKEN"
        assert str(tmp_path / "tokens.json") in entry["message"]
        # every role reports: where the coordinator listens and what to start, status lines, log files
        said = (tmp_path / "coordinator.log").read_text()
        assert f"listening at {endpoint['url']}" in said
        assert f"dashboard: {endpoint['url']}/dashboard#token=TOKEN" in said  # the token stays in its file
        assert endpoint["dashboard_url"].split("#token=")[1] not in said
        assert f"tokens: {tmp_path / 'tokens.json'}" in said and "coordinator INFO status: version " in said
        assert "connected: trainer yes, verifier no, scorer no" in said
        assert "waiting for a verifier" in (tmp_path / "trainer.log").read_text()
        assert "worker.loop INFO status: " in (tmp_path / "worker-0" / "worker.log").read_text()
        # the run directory is this coordinator's: a second one is refused in one line
        second = subprocess.run(
            [sys.executable, "-m", "decentrl", "coordinator", "--config", str(config)]
            + ["--run-dir", str(tmp_path), "--model-dir", str(model_dir), "--port", "0"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2, second.stderr[-2000:]
        refusal = second.stderr.strip().splitlines()
        assert refusal[-1].startswith("decentrl: error: another coordinator is serving the run directory")
        assert "Traceback" not in second.stderr and f"pid {coordinator.process.pid}" in refusal[-1]
        assert (tmp_path / "coordinator.json").is_file()
        # the verifier arrives: the run goes on to its end, and says so
        roles.append(start_verifier(tmp_path, model_dir, config, endpoint))
        worker = roles[2]
        wait_until(lambda: not trainer.alive() and not worker.alive(), "the trainer and worker to end", roles)
        assert trainer.process.returncode == 0 and worker.process.returncode == 0
        assert "the run is complete: v3/3 published" in trainer.log_path.read_text()
        assert "the run is complete" in worker.log_path.read_text()
        with CoordinatorClient(endpoint["url"], endpoint["trainer_token"], max_wait=30) as client:
            wait_until(lambda: client.stats()["run"]["state"] == "complete", "the run state", roles)
        assert overview(endpoint)["run"]["complete"]["version"] == 3
        said = coordinator.log_path.read_text()
        assert "run complete: version 3 published" in said and "rollouts accepted" in said
        # before and after: the trainer evaluates version 0, the model before any update, first
        assert re.search(
            r"held-out accuracy \(first -> last eval\) \d\.\d{3} \(v0\) -> \d\.\d{3} \(v3\)", said
        )
        assert "v0 held-out accuracy " in trainer.log_path.read_text()
        # the run's config, the trainer's own settings included, is what eval and export read
        assert load_config(tmp_path / "config.json").trainer.num_steps == 3
        # a finished trainer started again says so and exits 0
        again = start_trainer(tmp_path, model_dir, config, endpoint, "--set", "trainer.num_steps=3")
        roles.append(again)
        wait_until(lambda: not again.alive(), "the restarted trainer to exit", roles)
        assert again.process.returncode == 0
        assert again.log_path.read_text().count("the run is complete: v3/3 published") == 2
    finally:
        for role in roles:
            role.stop()


def test_a_wrong_token_or_another_runs_worker_state_is_one_line(tmp_path, capsys) -> None:
    from weights_support import Coordinator, tiny_model

    from decentrl.cli import main

    model = tmp_path / "model"
    tiny_model(model)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    first, second = Coordinator(tmp_path / "a", model), Coordinator(tmp_path / "b", model)
    try:
        state = tmp_path / "worker-state"
        first.worker_client(state).close()  # registered with the first run
        capsys.readouterr()
        errors = {}
        for role, extra in (("trainer", ["--run-dir", str(tmp_path / "t")]), ("verifier", [])):
            argv = [role, "--coordinator", second.url, "--token=not-the-token", "--model-dir", str(model)]
            assert main(argv + extra) == 2
            errors[role] = capsys.readouterr().err.strip()
        assert main(["worker", "--coordinator", second.url, "--state-dir", str(state)]) == 2
        errors["worker"] = capsys.readouterr().err.strip().splitlines()[-1]
    finally:
        first.stop()
        second.stop()
    for role in ("trainer", "verifier"):
        assert errors[role] == (
            f"decentrl: error: the coordinator at {second.url} refused the {role}'s token; pass "
            "--token=TRAINER_TOKEN, the trainer_token of tokens.json in the coordinator's run directory"
        )
    assert errors["worker"].startswith(f"decentrl: error: the credentials saved in {state} are another")
    assert "not this run's" in errors["worker"] and "--token" in errors["worker"]
