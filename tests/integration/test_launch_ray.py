"""`decentrl launch ray` on a local Ray cluster (loopback): the whole system as Ray actors.

Versions advance on rollouts from the Ray-managed workers, rewarded in part by a reward model that
only the launcher's `decentrl scorer` actor can score (no group trains without its scores); a
SIGKILLed worker actor is replaced by Ray (a new actor, a new worker process, the same identity, more rollouts); Ctrl-C stops every role
and Ray itself, leaving no process behind. Ray is an optional extra: skipped without it.
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
from processes import alive, cmdline, descendants
from test_loop import db_rows, wait_until, write_config

from decentrl.config import ModelConfig
from decentrl.model.tiny import build_tiny, save_model_dir

pytest.importorskip("ray")
pytestmark = pytest.mark.integration


class Launcher:
    """`decentrl launch ray` as a process, quacking like a `Role` for `wait_until`."""

    def __init__(self, config: Path, run_dir: Path):
        self.name = "launch-ray"
        self.log_path = run_dir.parent / "launch.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
        command = [sys.executable, "-m", "decentrl", "launch", "ray", "--config", str(config)]
        self.process = subprocess.Popen(
            [*command, "--run-dir", str(run_dir)], stdout=self._log, stderr=subprocess.STDOUT, env=env
        )

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        if self.alive():
            self.process.kill()
            self.process.wait()
        self._log.close()


def worker_process(name: str, parent_of: dict[int, int] | None = None) -> tuple[int, int] | None:
    """(pid, actor pid) of the worker role process named `name`, if one runs."""
    for stat in Path("/proc").glob("[0-9]*/cmdline"):
        pid = int(stat.parent.name)
        args = cmdline(pid)
        if "worker" in args and name in args and "decentrl" in args and alive(pid):
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            return pid, ppid
    return None


def rollouts_of(run_dir: Path, name: str) -> int:
    query = f"SELECT COUNT(*) FROM rollouts r JOIN workers w USING (worker_id) WHERE w.name = '{name}'"
    return db_rows(run_dir, query)[0][0]


def test_ray_launch_trains_replaces_a_dead_worker_and_leaves_nothing(tmp_path):
    from decentrl.rewards.reward_model import load_reward_model

    model_dir = save_model_dir(*build_tiny(ModelConfig()), tmp_path / "model")
    rm_dir = tmp_path / "rm"
    for part in load_reward_model(model_dir):  # an untrained head: any scores will do
        part.save_pretrained(rm_dir)
    terms = f'[{{function = "env"}}, {{function = "reward_model", name = "rm", weight = 0.1, args = {{path = "{rm_dir}"}}}}]'
    config = write_config(
        tmp_path,
        f"model.path={str(model_dir)!r}",
        f"reward.terms={terms}",
        "trainer.num_steps=1000",  # runs until interrupted
        "trainer.eval_every=0",
        "ray.num_cpus=8",
        "ray.num_workers=2",
        "ray.coordinator.num_cpus=1",
        "ray.trainer.num_cpus=1",
        "ray.worker.num_cpus=1",
    )
    run_dir = tmp_path / "run"
    launcher = Launcher(config, run_dir)
    roles = [launcher]
    try:
        wait_until(lambda: (run_dir / "ray.json").is_file(), "the launcher to announce", roles)
        where = json.loads((run_dir / "ray.json").read_text())
        assert where["coordinator_url"].startswith("http://127.0.0.1:") and where["dashboard"] is None
        wait_until(lambda: len(db_rows(run_dir, "SELECT version FROM weights")) >= 3, "version 2", roles, 300)
        trained = """SELECT COUNT(*) FROM rollouts r JOIN tasks t USING (task_id) JOIN workers w
            USING (worker_id) WHERE t.state = 'trained' AND w.name LIKE 'ray-worker-%'"""
        assert db_rows(run_dir, trained)[0][0] > 0
        scored = "SELECT COUNT(*) FROM reward_scores WHERE json_extract(terms, '$.rm') IS NOT NULL"
        assert db_rows(run_dir, scored)[0][0] > 0  # the scorer actor's reward model did score
        assert "reward model" in (run_dir / "logs" / "scorer-rm.log").read_text()
        victim = worker_process("ray-worker-0")
        assert victim is not None
        role_pid, actor_pid = victim
        before = rollouts_of(run_dir, "ray-worker-0")
        os.kill(actor_pid, signal.SIGKILL)
        wait_until(
            lambda: (w := worker_process("ray-worker-0")) is not None and w[1] != actor_pid,
            "Ray to restart the worker actor",
            roles,
            180,
        )
        wait_until(lambda: not alive(role_pid), "the orphaned worker to stop itself", roles, 60)
        wait_until(lambda: rollouts_of(run_dir, "ray-worker-0") > before, "the new worker's rollouts", roles)
        assert (
            len(db_rows(run_dir, "SELECT DISTINCT worker_id FROM workers WHERE name = 'ray-worker-0'")) == 1
        )
        started = descendants(launcher.process.pid)
        assert len(started) >= 6  # Ray's own processes, the actors and the roles
        launcher.process.send_signal(signal.SIGINT)
        assert launcher.process.wait(timeout=180) == 130, launcher.log_path.read_text()[-3000:]
        deadline = time.monotonic() + 30
        while (left := [pid for pid in started if alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, [(pid, cmdline(pid)[:4]) for pid in left]
        log = launcher.log_path.read_text()
        assert "workers outside the cluster join with: decentrl worker --coordinator" in log
    finally:
        launcher.close()
