"""A worker's state directory holds its key: one live worker per directory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from decentrl.config import ConfigError
from decentrl.worker.credentials import hold_state_dir


def test_a_second_worker_on_one_state_dir_is_refused_until_the_first_is_gone(tmp_path) -> None:
    held = hold_state_dir(tmp_path)
    with pytest.raises(ConfigError, match=f"another worker \\(pid {os.getpid()}\\) uses --state-dir"):
        hold_state_dir(tmp_path)
    os.close(held)
    os.close(hold_state_dir(tmp_path))  # released: taken again

    # A worker killed outright releases it too (the kernel drops the lock with the process).
    code = "import sys, time; from pathlib import Path; from decentrl.worker.credentials import "
    code += "hold_state_dir; hold_state_dir(Path(sys.argv[1])); print('held', flush=True); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=f"pid {child.pid}"):
            hold_state_dir(tmp_path)
    finally:
        child.kill()
        child.wait(10)
    os.close(hold_state_dir(tmp_path))


def test_a_state_dir_that_cannot_be_written_is_one_line(tmp_path) -> None:
    from decentrl.config import WorkerConfig
    from decentrl.worker import run_worker

    taken = tmp_path / "a-file"
    taken.write_text("not a directory")
    config = WorkerConfig(coordinator_url="http://127.0.0.1:9", token="x", state_dir=str(taken))
    with pytest.raises(ConfigError, match=f"cannot write in the state directory {taken} .*--state-dir"):
        run_worker(config)
