"""Roles forked from the launcher (`launch/fork.py`): separate processes with their own logs,
exit statuses and names. Each test's launcher is a fresh process, as the demo is (a test runner
that has started threads may not fork)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from decentrl.config import ModelConfig
from decentrl.model.tiny import build_tiny, save_model_dir

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not hasattr(os, "fork") or not Path("/proc").is_dir(), reason="forks, reads /proc"),
]

LAUNCHER = """
import json, os, sys, time
from pathlib import Path
from decentrl.launch.fork import ForkedProcess
from decentrl.launch.local import Role, wait_for_coordinator
run_dir, model_dir = Path(sys.argv[1]), sys.argv[2]
report = {"launcher": os.getpid()}
shown = Role("trainer", ["config", "show", "--section", "trainer"], run_dir, fork=True)
report["forked"] = isinstance(shown.process, ForkedProcess)
report["pid"] = shown.process.pid
report["status"] = shown.process.wait(60)
mistaken = Role("worker-0", ["config", "show", "--section", "nope"], run_dir, fork=True)
report["mistaken_status"] = mistaken.process.wait(60)
mistaken.stop()
args = ["coordinator", "--run-dir", str(run_dir), "--model-dir", model_dir, "--port", "0"]
coordinator = Role("coordinator", args, run_dir, fork=True)
wait_for_coordinator(run_dir, coordinator)
report["coordinator_alive"] = coordinator.alive()
report["comm"] = Path(f"/proc/{coordinator.process.pid}/comm").read_text().strip()
report["coordinator_status"] = coordinator.stop()  # SIGTERM, as the demo stops its roles
report["coordinator_reaped"] = not Path(f"/proc/{coordinator.process.pid}").exists()
# What the launcher holds when it forks is frozen: a child's full collection does not walk it
# (writing to every page it shares with the launcher). Exit 0 when the child sees it frozen.
import gc
from decentrl.launch.fork import fork_call
held = [[] for _ in range(100_000)]  # lists are tracked by the collector (empty dicts are not)
with open(run_dir / "logs" / "gc-probe.log", "ab") as log:
    probe = fork_call("gc-probe", lambda: 0 if gc.get_freeze_count() > len(held) else 3, log.fileno(), {})
report["frozen_status"] = probe.wait(60)
# The warm start's evaluation aside: one torch thread at the lowest priority, beside the roles.
from decentrl.config import RunConfig
import decentrl.launch.evaluation as evaluation
evaluation.held_out_accuracy = lambda config, model_dir, state=None, threads=2: {"threads": threads, "nice": os.nice(0)}
aside = evaluation.EvaluationAside(RunConfig(), Path(model_dir), run_dir / "logs")
aside.start()
report["aside_forked"] = aside.process is not None
report["aside"] = aside.result()
print(json.dumps(report), flush=True)
"""


def test_a_forked_role_runs_its_command_in_a_process_of_its_own(tmp_path):
    model_dir = save_model_dir(*build_tiny(ModelConfig()), tmp_path / "model")
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", LAUNCHER, str(run_dir), str(model_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["forked"] and report["pid"] != report["launcher"]
    assert report["status"] == 0
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert f"trainer: forked from the launcher (pid {report['launcher']})" in log
    assert "[trainer]" in log and "num_threads" in log  # the command's own output, in its log
    # A user's mistake: exit 2 and one line naming the fix, as when spawned.
    assert report["mistaken_status"] == 2
    assert "decentrl: error: unknown section 'nope'" in (run_dir / "logs" / "worker-0.log").read_text()
    # A server role stops gracefully on SIGTERM and is reaped by its launcher.
    assert report["coordinator_alive"] and report["coordinator_status"] == 0
    assert report["comm"] == "coordinator"  # ps, top and the throughput bench see the role's name
    assert report["coordinator_reaped"]
    assert report["frozen_status"] == 0, (run_dir / "logs" / "gc-probe.log").read_text()
    assert report["aside_forked"] and report["aside"] == {"threads": 1, "nice": 19}


WARM_START = """
import json, sys
from pathlib import Path
from decentrl.config import load_config
from decentrl.launch.local import warm_started_model
cache, run_dir = sys.argv[1], Path(sys.argv[2])
run_dir.mkdir(parents=True)
overrides = ["model.hidden_size=32", "model.num_heads=1", "model.intermediate_size=32", "model.num_layers=1",
             "sft.steps=2", f"sft.cache_dir={cache!r}"]
model_dir = warm_started_model(load_config(None, overrides), run_dir)
print(json.dumps({"trained": (model_dir / "model.safetensors").is_file(), "torch": "torch" in sys.modules}))
"""


def test_a_warm_start_to_train_is_trained_in_a_process_of_its_own(tmp_path):
    """The demo forks its roles after the warm start: had the launcher trained it, torch's
    OpenMP pool would be in the launcher, and a forked role would hang in its first parallel
    region. So the launcher never even imports torch for it."""
    done = subprocess.run(
        [sys.executable, "-c", WARM_START, str(tmp_path / "cache"), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report == {"trained": True, "torch": False}


AFTER_TORCH = """
import json, sys
from pathlib import Path
import torch
from decentrl.launch.fork import ForkedProcess, can_fork, preload
from decentrl.launch.local import Role
run_dir = Path(sys.argv[1])
preload(["trainer"])
report = {"after_imports": can_fork()}
torch.set_num_threads(2)
matrix = torch.randn(512, 512)
float((matrix @ matrix).sum())  # a parallel region: OpenMP starts its pool
report["after_a_parallel_matmul"] = can_fork()
role = Role("trainer", ["config", "show", "--section", "trainer"], run_dir, fork=True)
report["forked"] = isinstance(role.process, ForkedProcess)
report["status"] = role.process.wait(120)
print(json.dumps(report), flush=True)
"""


def test_a_launcher_that_computed_with_torch_spawns_its_roles(tmp_path):
    # A second run in one process (bench staleness runs cells back to back) comes after the first
    # run's evaluation; a role forked into its OpenMP pool waited forever in its first parallel region.
    done = subprocess.run(
        [sys.executable, "-c", AFTER_TORCH, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["after_imports"] and not report["after_a_parallel_matmul"]
    assert not report["forked"] and report["status"] == 0


def test_a_demo_whose_only_worker_fails_ends_with_its_reason_instead_of_waiting(tmp_path):
    # A demo whose one worker died waited for rollouts that never came until a test's timeout.
    model_dir = save_model_dir(*build_tiny(ModelConfig()), tmp_path / "model")
    worker = tmp_path / "worker-python"
    worker.write_text('#!/bin/sh\necho "this worker cannot start: no engine here" >&2\nexit 3\n')
    worker.chmod(0o755)
    overrides = [f"model.path={str(model_dir)!r}", f"worker.python={str(worker)!r}", "demo.num_workers=1"]
    done = subprocess.run(
        [sys.executable, "-m", "decentrl", "demo", "--run-dir", str(tmp_path / "run")]
        + [arg for override in overrides for arg in ("--set", override)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    log = tmp_path / "run" / "logs" / "worker-0.log"
    assert done.stderr.strip().splitlines()[-1] == (
        "decentrl: error: worker-0 exited (status 3) before the trainer finished; no worker is left to "
        f"generate rollouts. See {log}; its last line: this worker cannot start: no engine here"
    )
