"""A role started by a launcher stops by itself when the launcher is SIGKILLed (no orphans)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from decentrl.config import ModelConfig
from decentrl.model.tiny import build_tiny, save_model_dir

pytestmark = pytest.mark.integration

LAUNCHER = """
import sys, time
from pathlib import Path
from decentrl.launch.local import Role, wait_for_coordinator
run_dir, model_dir, fork = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "fork"
args = ["coordinator", "--run-dir", str(run_dir), "--model-dir", model_dir, "--port", "0"]
role = Role("coordinator", args, run_dir, fork=fork)
assert fork == (type(role.process).__name__ == "ForkedProcess")
wait_for_coordinator(run_dir, role)
print(role.process.pid, flush=True)
time.sleep(600)
"""


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by init, maybe later)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
@pytest.mark.parametrize("start", ["spawn", "fork"])
def test_a_role_stops_gracefully_when_its_launcher_is_killed(tmp_path, start):
    """Spawned (`python -m decentrl ROLE`) or forked from the launcher, as the demo starts it."""
    model_dir = save_model_dir(*build_tiny(ModelConfig()), tmp_path / "model")
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path / "run"), str(model_dir), start],
        stdout=subprocess.PIPE,
        text=True,
    )
    pid = None
    try:
        pid = int(launcher.stdout.readline())
        assert running(pid)
        time.sleep(1.5)  # a launcher that stays is not mistaken for a dead one
        assert running(pid)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 20
        while running(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not running(pid), "the coordinator outlived its launcher"
        log = (tmp_path / "run" / "logs" / "coordinator.log").read_text()
        assert "the launcher" in log and "is gone" in log  # it stopped itself, gracefully
    finally:
        launcher.kill()
        if pid is not None and running(pid):
            os.kill(pid, signal.SIGKILL)
