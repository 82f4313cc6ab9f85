"""A served task through the real roles, with env instances killed at random (processes on loopback).

Coordinator, trainer, an env server (`decentrl envd`) and two workers as processes; the task is
`tool_use`, served. While the run goes on, a killer sends SIGKILL to one of the env server's
instance processes every second or so. The run must still finish, every rollout accepted before a
kill must still be there at the end, the failures must be counted by reason, and no episode that
ended by an environment failure may be stored or trained: every stored rollout's signed end names
an episode the coordinator never saw fail, with the reward it signed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading

import pytest
from processes import cmdline, descendants
from test_loop import db_rows, model_dir, start_system, start_trainer, start_worker, wait_until, write_config

from decentrl.client import CoordinatorClient
from decentrl.launch.local import Role

pytestmark = pytest.mark.integration
__all__ = ["model_dir"]


def start_envd(run_dir, config, endpoint) -> Role:
    args = ["envd", "--config", str(config), "--coordinator", endpoint["url"]]
    return Role("envd-0", [*args, f"--token={endpoint['trainer_token']}", "--name", "envd-0"], run_dir)


def instances(envd: Role) -> list[int]:
    return [pid for pid in descendants(envd.process.pid) if "decentrl.envd.instance" in cmdline(pid)]


@pytest.mark.slow  # 60-90 s on two shared cores; tests/adversarial/test_served_attacks.py covers the path in CI
def test_env_instances_killed_at_random_lose_no_accepted_rollout_and_train_no_failed_episode(
    tmp_path, model_dir
):
    config = write_config(
        tmp_path,
        'task.env="tool_use"',
        'task.args={tool_format="python", max_turns=3}',
        "task.served=true",
        "task.max_env_retries=2",
        "coordinator.max_new_tokens=16",
        "coordinator.lease_seconds=15.0",
        "trainer.num_steps=8",
        "trainer.eval_every=0",
        "envd.instances=2",
        "envd.sessions_per_instance=8",
    )
    coordinator, endpoint = start_system(tmp_path, model_dir, config)
    roles = [coordinator]
    stop, kills, seen = threading.Event(), [], set()

    def killer(envd: Role) -> None:
        rng = random.Random(0)
        while not stop.wait(rng.uniform(0.5, 1.5)):
            found = instances(envd)
            if found:
                victim = rng.choice(found)
                os.kill(victim, signal.SIGKILL)
                kills.append(victim)
            seen.update(row[0] for row in db_rows(tmp_path, "SELECT rollout_id FROM rollouts"))

    try:
        envd = start_envd(tmp_path, config, endpoint)
        trainer = start_trainer(tmp_path, model_dir, config, endpoint)
        roles += [envd, trainer, start_worker("worker-0", tmp_path, config, endpoint)]
        roles.append(start_worker("worker-1", tmp_path, config, endpoint))
        thread = threading.Thread(target=killer, args=(envd,), daemon=True)
        thread.start()
        wait_until(lambda: not trainer.alive(), "the trainer to finish 8 steps", roles, timeout=400)
        stop.set()
        thread.join()
        assert trainer.process.returncode == 0, trainer.log_path.read_text()[-3000:]
        with CoordinatorClient(endpoint["url"], endpoint["trainer_token"], max_wait=30) as client:
            stats = client.stats()
        assert stats["latest_version"] == 8
        assert len(kills) >= 5
        failures = stats["envd"]["failures"]
        assert failures.get("crash", 0) >= 1, stats["envd"]
        stored = {
            row[0]: row for row in db_rows(tmp_path, "SELECT rollout_id, payload, reward FROM rollouts")
        }
        assert seen and seen <= set(stored)  # nothing accepted before a kill was lost
        states = dict(db_rows(tmp_path, "SELECT episode_id, state FROM env_episodes"))
        trained = 0
        for rollout_id, payload, reward in stored.values():
            end = json.loads(payload)["served"]["end"]
            assert states[end["episode_id"]] == "open", f"{rollout_id} is a failed episode"
            assert end["failure"] is None and end["reward"] == reward
            trained += 1
        assert trained == stats["rollouts_accepted"]
        failed = [e for e, state in states.items() if state == "failed"]
        assert len(failed) == sum(failures.values()) >= 1
        metrics = client_metrics(endpoint["url"])
        assert 'decentrl_env_failures_total{reason="crash"}' in metrics
    finally:
        stop.set()
        for role in reversed(roles):
            role.stop()


def client_metrics(url: str) -> str:
    import httpx

    return httpx.get(f"{url}/metrics", timeout=30).text
