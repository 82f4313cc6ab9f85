"""`decentrl launch ray` on a local Ray cluster (loopback): the whole system as Ray actors.

Versions advance on rollouts from the Ray-managed workers, rewarded in part by a reward model that
only the launcher's `decentrl scorer` actor can score (no group trains without its scores); a
SIGKILLed worker actor is replaced by Ray (a new actor, a new worker process, the same identity,
more rollouts); Ctrl-C stops every role and Ray itself, leaving no process behind. Ray is an
optional extra: skipped without it, except under `make test-all`, which installs it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from processes import alive, cmdline, descendants
from test_loop import db_rows, write_config

from decentrl.config import ModelConfig
from decentrl.model.tiny import build_tiny, save_model_dir

# `make test-all` installs the ray extra and sets DECENTRL_REQUIRE_RAY=1: a broken install fails
# there instead of skipping; elsewhere (a venv without the extra) the test is skipped.
if os.environ.get("DECENTRL_REQUIRE_RAY"):
    import ray  # noqa: F401
else:
    pytest.importorskip("ray")
pytestmark = pytest.mark.integration

# Deadlines come from the work, not from a guess at the machine's speed: a wait fails when nothing
# moved for STALL_SECONDS (no file of the run grew, no process started or ended, no launcher line,
# no role used CPU), or when the launcher exited. On a loaded machine every stage is slow but
# something always moves; a hung role moves nothing. LONGEST_SECONDS bounds the whole test, for a
# system that keeps busy going nowhere (at load 30 on 2 cores the test took 20 minutes: the
# default pytest-timeout of 20 minutes cut it just after the last stage began).
STALL_SECONDS = 180.0
LONGEST_SECONDS = 2700.0
# Ray itself waits a fixed 30 s for its raylet to register with its GCS (ray/_private/node.py) and
# gives up on a loaded machine; the launcher then exits at once, and only that is started again.
RAY_NODE_TIMEOUT = "The current node timed out during startup"
RAY_START_ATTEMPTS = 3


class Launcher:
    """`decentrl launch ray` as a process, quacking like a `Role` for `wait_until`."""

    def __init__(self, config: Path, run_dir: Path):
        self.name = "launch-ray"
        self.log_path = run_dir.parent / f"launch-{run_dir.name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
        command = [sys.executable, "-m", "decentrl", "launch", "ray", "--config", str(config)]
        self.started = time.monotonic()
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

    def work(self, run_dir: Path) -> tuple[int, ...]:
        """What moves while the system works: the bytes the roles wrote, the launcher's output, the
        processes under the launcher (Ray's, the actors, the roles) and the CPU time of the roles
        (a role still importing torch on a loaded machine writes nothing yet; a hung one burns no
        CPU). Ray's own daemons are left out of the CPU time: they tick while the roles hang."""
        written = 0
        for path in run_dir.rglob("*"):
            with contextlib.suppress(OSError):  # renamed or removed while we looked
                written += path.stat().st_size if path.is_file() else 0
        processes = descendants(self.process.pid)
        roles_cpu = sum(cpu_ticks(pid) for pid in processes if "decentrl" in cmdline(pid))
        return written, self.log_path.stat().st_size, len(processes), roles_cpu

    def wait(self, condition, what: str, run_dir: Path, exits: bool = False) -> None:
        """Until `condition()`; fails when the launcher exits first (unless `exits`), when nothing
        moved for STALL_SECONDS, or LONGEST_SECONDS after the launcher started."""
        moved = time.monotonic()
        seen: tuple[int, ...] = ()
        while not condition():
            if not exits and not self.alive():
                pytest.fail(f"the launcher exited ({self.process.returncode}) before {what}\n{self.tail()}")
            now = time.monotonic()
            if (work := self.work(run_dir)) != seen:
                seen, moved = work, now
            if now - moved > STALL_SECONDS or now - self.started > LONGEST_SECONDS:
                idle, total = now - moved, now - self.started
                pytest.fail(
                    f"waiting for {what}: nothing moved for {idle:.0f} s ({total:.0f} s in all)\n{self.tail()}"
                )
            time.sleep(1.0)

    def tail(self) -> str:
        return self.log_path.read_text()[-3000:]


def cpu_ticks(pid: int) -> int:
    """User + system CPU time of a process, in clock ticks (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def announced_launcher(config: Path, tmp_path: Path) -> tuple[Launcher, Path]:
    """A launcher that announced its coordinator, and its run directory."""
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        run_dir = tmp_path / f"run{attempt}"
        launcher, announced = Launcher(config, run_dir), run_dir / "ray.json"
        try:
            launcher.wait(announced.is_file, "the launcher to announce", run_dir)
            return launcher, run_dir
        except pytest.fail.Exception:
            launcher.close()
            if RAY_NODE_TIMEOUT not in launcher.log_path.read_text() or attempt == RAY_START_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


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


@pytest.mark.slow  # 100 s on a quiet 2-core machine, most of it Ray's own start; `make test-all`
@pytest.mark.timeout(LONGEST_SECONDS + 120)
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
    launcher, run_dir = announced_launcher(config, tmp_path)
    try:
        where = json.loads((run_dir / "ray.json").read_text())
        assert where["coordinator_url"].startswith("http://127.0.0.1:") and where["dashboard"] is None
        launcher.wait(lambda: len(db_rows(run_dir, "SELECT version FROM weights")) >= 3, "version 2", run_dir)
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
        launcher.wait(
            lambda: (w := worker_process("ray-worker-0")) is not None and w[1] != actor_pid,
            "Ray to restart the worker actor",
            run_dir,
        )
        launcher.wait(lambda: not alive(role_pid), "the orphaned worker to stop itself", run_dir)
        launcher.wait(
            lambda: rollouts_of(run_dir, "ray-worker-0") > before, "the new worker's rollouts", run_dir
        )
        assert (
            len(db_rows(run_dir, "SELECT DISTINCT worker_id FROM workers WHERE name = 'ray-worker-0'")) == 1
        )
        started = descendants(launcher.process.pid)
        assert len(started) >= 6  # Ray's own processes, the actors and the roles
        launcher.process.send_signal(signal.SIGINT)
        launcher.wait(lambda: not launcher.alive(), "the launcher to stop every role", run_dir, exits=True)
        assert launcher.process.returncode == 130, launcher.tail()
        launcher.wait(
            lambda: not any(alive(pid) for pid in started),
            "every process it started to end",
            run_dir,
            exits=True,
        )
        log = launcher.log_path.read_text()
        assert "workers outside the cluster join with: decentrl worker --coordinator" in log
    finally:
        launcher.close()


def envd_process(name: str) -> tuple[int, int] | None:
    """(pid, actor pid) of the env-server role process named `name`, if one runs."""
    for stat in Path("/proc").glob("[0-9]*/cmdline"):
        pid = int(stat.parent.name)
        args = cmdline(pid)
        if "envd" in args and name in args and "decentrl" in args and alive(pid):
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            return pid, ppid
    return None


@pytest.mark.slow  # Ray's own start dominates, as above; `make test-all`
@pytest.mark.timeout(LONGEST_SECONDS + 120)
def test_ray_launch_runs_env_servers_as_actors_and_restarts_a_dead_one(tmp_path):
    """A served task: `envd.num_servers` env-server actors announce themselves, workers' rollouts
    carry their signed turns, and a SIGKILLed env-server actor comes back under the same key."""
    model_dir = save_model_dir(*build_tiny(ModelConfig()), tmp_path / "model")
    config = write_config(
        tmp_path,
        f"model.path={str(model_dir)!r}",
        'task.env="tool_use"',
        'task.args={tool_format="python", max_turns=3}',
        "task.served=true",
        "coordinator.max_new_tokens=16",
        "trainer.num_steps=1000",
        "trainer.eval_every=0",
        "envd.num_servers=2",
        "envd.instances=1",
        "ray.num_cpus=8",
        "ray.num_workers=1",
        "ray.envd.num_cpus=1",
        "ray.coordinator.num_cpus=1",
        "ray.trainer.num_cpus=1",
        "ray.worker.num_cpus=1",
    )
    launcher, run_dir = announced_launcher(config, tmp_path)
    try:
        live = "SELECT server_id, public_key FROM env_servers ORDER BY server_id"
        launcher.wait(lambda: len(db_rows(run_dir, live)) == 2, "two env servers to announce", run_dir)
        keys = dict(db_rows(run_dir, live))
        assert set(keys) == {"envd-0", "envd-1"}
        launcher.wait(lambda: len(db_rows(run_dir, "SELECT version FROM weights")) >= 2, "version 1", run_dir)
        served = db_rows(run_dir, "SELECT payload FROM rollouts LIMIT 20")
        assert served and all(json.loads(p)["served"]["end"]["server_id"] in keys for (p,) in served)
        victim = envd_process("envd-0")
        assert victim is not None
        role_pid, actor_pid = victim
        os.kill(actor_pid, signal.SIGKILL)
        launcher.wait(
            lambda: (e := envd_process("envd-0")) is not None and e[1] != actor_pid,
            "Ray to restart the env-server actor",
            run_dir,
        )
        launcher.wait(lambda: not alive(role_pid), "the orphaned env server to stop itself", run_dir)
        assert dict(db_rows(run_dir, live)) == keys  # its signing key survived in its state directory
        launcher.process.send_signal(signal.SIGINT)
        launcher.wait(lambda: not launcher.alive(), "the launcher to stop every role", run_dir, exits=True)
    finally:
        launcher.close()
