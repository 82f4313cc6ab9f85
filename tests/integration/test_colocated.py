"""Colocated mode: the trainer samples groups with its own model and sends them to the coordinator
with its token (`trainer.local_groups`, trainer/local_rollouts.py).

- The routes, through FastAPI's TestClient: the trainer's rollouts get the coordinator's reward,
  not the one they claim, skip sampled verification, and nobody else may use the routes.
- Real processes on loopback (the tiny model): a colocated trainer alone trains its own rollouts,
  each counted with its staleness; beside a remote worker both are trained; a SIGKILLed colocated
  trainer resumes with every accepted rollout kept and every batch trained once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_coordinator_api import Harness
from test_loop import db_rows, start_system, start_trainer, start_worker, wait_until, write_config
from test_trainer_durability import checkpointed_version

from decentrl.client import CoordinatorClient
from decentrl.config import ModelConfig
from decentrl.config.trust import TrustConfig
from decentrl.coordinator.pipeline.leasing import LOCAL_WORKER
from decentrl.model.tiny import build_tiny, save_model_dir

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_model_dir(*build_tiny(ModelConfig()), tmp_path_factory.mktemp("model"))


def test_the_trainers_rollouts_get_the_coordinators_rewards_and_no_verification(tmp_path, model_dir):
    harness = Harness(tmp_path / "run", model_dir)
    # every worker submission would be held for a verifier; the trainer's own are trusted
    harness.config = harness.config.model_copy(update={"trust": TrustConfig(verify_fraction=1.0)})
    harness.stop()
    harness.start()
    try:
        harness.publish(0)
        trainer, client = harness.trainer, harness.client
        # More groups than a new worker may hold (trust.lease_groups_new = 8): only room bounds it.
        answer = client.post(
            "/v1/trainer/leases", json={"policy_version": 0, "max_groups": 10}, headers=trainer
        )
        assert answer.status_code == 200, answer.text
        lease = answer.json()
        assert len(lease["tasks"]) == 10
        # claimed rewards inverted: the coordinator's rubric decides (task 0 right, task 1 wrong)
        rollouts = [harness.rollout(lease, 0, slot, correct=True) for slot in range(2)]
        rollouts += [harness.rollout(lease, 1, slot, correct=False) for slot in range(2)]
        worker = harness.register()
        body = {"rollouts": rollouts}
        assert client.post("/v1/trainer/rollouts", json=body, headers=worker).status_code == 401
        assert (
            client.post("/v1/trainer/leases", json={"policy_version": 0}, headers=worker).status_code == 401
        )
        # a worker cannot fill the trainer's slots either
        assert client.post("/v1/rollouts", json=body, headers=worker).status_code == 403
        answer = client.post("/v1/trainer/rollouts", json=body, headers=trainer)
        assert answer.status_code == 200, answer.text
        assert answer.json()["groups_completed"] == 2
        harness.settle()
        rewards = dict(
            harness.query("SELECT slot || task_id, reward FROM rollouts WHERE worker_id = ?", LOCAL_WORKER)
        )
        first, second = lease["tasks"][0]["task_id"], lease["tasks"][1]["task_id"]
        assert rewards == {f"0{first}": 1.0, f"1{first}": 1.0, f"0{second}": 0.0, f"1{second}": 0.0}
        assert harness.query("SELECT COUNT(*) FROM verify_jobs")[0][0] == 0
        assert harness.query("SELECT COUNT(*) FROM holds")[0][0] == 0
        batch = client.post(
            "/v1/trainer/batches", json={"policy_version": 1, "max_groups": 2}, headers=trainer
        )
        assert batch.status_code == 200, batch.text
        assert {r["worker_id"] for g in batch.json()["groups"] for r in g["rollouts"]} == {LOCAL_WORKER}
        # the staleness of each issued rollout is recorded, as for workers' rollouts
        assert set(harness.query("SELECT staleness FROM rollouts")) == {(1,)}
        # a resubmission of the same slots is refused like a worker's: no rollout counted twice
        again = client.post("/v1/trainer/rollouts", json=body, headers=trainer)
        assert again.status_code == 409, again.text
        assert harness.query("SELECT COUNT(*) FROM rollouts")[0][0] == 4
    finally:
        harness.stop()


def test_a_colocated_trainer_alone_trains_its_own_rollouts(tmp_path, model_dir):
    # verify_fraction 1 and no verifier: a worker's groups would wait for verdicts forever
    config = write_config(
        tmp_path,
        "trainer.local_groups=4",
        "coordinator.max_pending_groups=16",
        "trainer.num_steps=5",
        "trainer.eval_every=0",
        "trust.verify_fraction=1.0",
    )
    coordinator, endpoint = start_system(tmp_path, model_dir, config)
    roles = [coordinator]
    try:
        trainer = start_trainer(tmp_path, model_dir, config, endpoint)
        roles.append(trainer)
        wait_until(lambda: not trainer.alive(), "the colocated trainer to finish 5 versions", roles)
        assert trainer.process.returncode == 0, trainer.log_path.read_text()[-3000:]
        with CoordinatorClient(endpoint["url"], endpoint["trainer_token"]) as client:
            stats = client.stats()
        assert stats["latest_version"] == 5
        assert {row[0] for row in db_rows(tmp_path, "SELECT DISTINCT worker_id FROM rollouts")} == {
            LOCAL_WORKER
        }
        # five batches of 4 groups of 4, each rollout trained once with its staleness recorded:
        # one round is sampled ahead, so local rollouts are trained one version after (the first at 0)
        staleness = db_rows(
            tmp_path, "SELECT staleness, COUNT(*) FROM rollouts WHERE staleness IS NOT NULL GROUP BY 1"
        )
        assert sum(count for _, count in staleness) == 5 * 16
        assert {age for age, _ in staleness} == {0, 1} and stats["staleness"]["mean"] > 0
        # every reward is the scoring pool's
        unscored = db_rows(
            tmp_path,
            "SELECT COUNT(*) FROM rollouts r LEFT JOIN reward_scores s ON s.rollout_id = r.rollout_id"
            " WHERE s.reward IS NULL OR s.reward != r.reward",
        )
        assert unscored == [(0,)]
        history = stats["history"]
        assert [h["policy_version"] for h in history] == [1, 2, 3, 4, 5]
        # one round of 16 per version, two from version 0, none from the last (nobody would train
        # it); the round from version 4, sampled while version 5 trains, counts if it finished
        # before version 5's metrics were taken
        sampled = sum(h["metrics"]["local_rollouts"] for h in history)
        assert sampled in (5 * 16, 6 * 16), [h["metrics"]["local_rollouts"] for h in history]
        assert db_rows(tmp_path, "SELECT COUNT(*) FROM verify_jobs") == [(0,)]
    finally:
        for role in reversed(roles):
            role.stop()


def sampler_of(trainer_pid: int) -> int:
    """The pid of a trainer's sampler process (its child named `trainer-sampler`)."""
    children = Path(f"/proc/{trainer_pid}/task/{trainer_pid}/children").read_text().split()
    named = [
        int(pid) for pid in children if Path(f"/proc/{pid}/comm").read_text().strip() == "trainer-sampler"
    ]
    assert len(named) == 1, children
    return named[0]


def running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow  # 26 s; tests/integration/test_trainer_durability.py kills a trainer in CI
def test_a_killed_colocated_trainer_beside_a_worker_loses_nothing(tmp_path, model_dir):
    """Half of each batch sampled by the trainer, the rest by a remote worker; the trainer is
    SIGKILLed after checkpointing v2 and restarted: versions stay contiguous, every batch is
    trained once, no accepted rollout disappears, and both samplers' rollouts are trained."""
    config = write_config(
        tmp_path,
        "trainer.local_groups=2",
        "coordinator.max_pending_groups=14",
        "trainer.num_steps=6",
        "trainer.eval_every=0",
        "coordinator.lease_seconds=4",
    )
    coordinator, endpoint = start_system(tmp_path, model_dir, config)
    roles = [coordinator]
    try:
        roles.append(start_worker("worker", tmp_path, config, endpoint))
        first = start_trainer(tmp_path, model_dir, config, endpoint)
        roles.append(first)
        wait_until(lambda: checkpointed_version(tmp_path) >= 2, "the checkpoint of v2", roles)
        sampler = sampler_of(first.process.pid)
        first.process.kill()
        first.process.wait()
        wait_until(lambda: not running(sampler), "the killed trainer's sampler to exit", roles)
        accepted = {row[0] for row in db_rows(tmp_path, "SELECT rollout_id FROM rollouts")}
        second = start_trainer(tmp_path, model_dir, config, endpoint)
        roles.append(second)
        wait_until(lambda: not second.alive(), "the restarted trainer to finish", roles)
        log = second.log_path.read_text()
        assert second.process.returncode == 0, log[-3000:]
        assert "resumed at version" in log, log[-3000:]
        assert accepted <= {row[0] for row in db_rows(tmp_path, "SELECT rollout_id FROM rollouts")}
        versions = sorted(row[0] for row in db_rows(tmp_path, "SELECT version FROM weights"))
        assert versions == list(range(7)), versions
        batches = db_rows(tmp_path, "SELECT state, acked_version FROM batches ORDER BY seq")
        assert batches[:6] == [("acked", version) for version in range(1, 7)], batches
        # a trained group belongs to exactly one acked batch
        trained = db_rows(
            tmp_path, "SELECT COUNT(*), COUNT(DISTINCT batch_id) FROM tasks WHERE state = 'trained'"
        )
        assert trained == [(6 * 4, 6)]
        samplers = db_rows(
            tmp_path,
            "SELECT DISTINCT r.worker_id = ? FROM rollouts r JOIN tasks t ON t.task_id = r.task_id"
            " WHERE t.state = 'trained'".replace("?", f"'{LOCAL_WORKER}'"),
        )
        assert {local for (local,) in samplers} == {0, 1}, "both the trainer's and the worker's were trained"
    finally:
        for role in reversed(roles):
            role.stop()


@pytest.mark.slow  # 30-60 s (a warm start of 20 steps, then four versions)
def test_demo_colocate_runs_the_coordinator_and_a_sampling_trainer_only(tmp_path):
    """`decentrl demo --colocate`: no worker and no verifier are started, and the trainer's own
    rollouts train every version."""
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "decentrl", "demo", "--colocate", "--run-dir", str(run_dir),
        "--set", "sft.steps=20", "--set", f"sft.cache_dir={str(tmp_path / 'cache')!r}",
        "--set", "trainer.num_steps=4", "--set", "trainer.eval_every=0", "--set", "task.eval_size=16",
        "--set", "demo.export=false", "--set", "demo.live=false",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    roles = sorted(path.name for path in (run_dir / "logs").glob("*.log"))
    assert roles == ["coordinator.log", "eval-before.log", "trainer.log"]  # the warm start's evaluation aside
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["num_policy_versions"] == 4 and summary["num_rollouts_rejected"] == 0
    assert db_rows(run_dir, "SELECT DISTINCT worker_id FROM rollouts") == [(LOCAL_WORKER,)]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["trainer"]["local_groups"] == config["trainer"]["groups_per_step"]
    assert config["demo"]["num_workers"] == 0
