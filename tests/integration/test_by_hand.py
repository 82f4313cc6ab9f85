"""The roles started by hand, one command each, as docs/operations.md has a newcomer do it: the
run says what it waits on, whom it misses, and when it is over."""

from __future__ import annotations

import time

import httpx
import pytest
from test_loop import model_dir, start_system, start_trainer, start_worker, wait_until, write_config

from decentrl.client import CoordinatorClient

pytestmark = pytest.mark.integration

__all__ = ["model_dir"]  # the module's fixture, shared


def overview(endpoint: dict) -> dict:
    url, token = endpoint["dashboard_url"].split("/dashboard?token=")
    answer = httpx.get(f"{url}/dashboard/api/overview", params={"token": token}, timeout=30)
    return answer.raise_for_status().json()


def test_a_run_without_its_verifier_says_within_a_minute_that_it_waits_for_one(tmp_path, model_dir):
    config = write_config(tmp_path, "trust.verify_fraction=1.0")
    coordinator, endpoint = start_system(tmp_path, model_dir, config)
    roles = [coordinator]
    try:
        trainer = start_trainer(tmp_path, model_dir, config, endpoint)
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
        assert f"listening at {endpoint['url']}" in said and endpoint["dashboard_url"] in said
        assert f"tokens: {tmp_path / 'tokens.json'}" in said and "status: version 0" in said
        assert "connected: trainer yes, verifier no, scorer no" in said
        assert "waiting for a verifier" in (tmp_path / "trainer.log").read_text()
        assert "worker.loop INFO status: " in (tmp_path / "worker-0" / "worker.log").read_text()
    finally:
        for role in roles:
            role.stop()
