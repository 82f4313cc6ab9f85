"""Roles forked from a launcher that has imported their modules once.

A role started as `python -m decentrl ROLE` spends seconds importing torch and transformers
before it does anything, and the demo starts four such roles at once: on two cores that was most
of the time from launch to the first version. A launcher that imports the roles' modules once
and then forks each role skips that work; the children are still separate processes with their
own logs, signals and exit codes, talking to the coordinator only over HTTP.

Forking is safe only before the launcher has threads or has computed with torch (an OpenMP
thread pool does not survive a fork): the launcher imports, forks every role, and only then
evaluates or follows progress. A forked role behaves as the spawned one: its stdout and stderr
go to its log, it runs `decentrl.cli.main(args)` with the same arguments and environment (torch
on `OMP_NUM_THREADS` threads), watches its launcher (`launch/parent.py`) and leaves with the
command's exit status, never unwinding into the launcher's code.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import io
import logging
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger(__name__)

ROLE_MODULES = {
    "coordinator": ("decentrl.coordinator.server",),
    "trainer": ("decentrl.trainer.loop", "decentrl.model.lora", "peft"),
    "worker": ("decentrl.worker.main", "decentrl.engines.registry", "decentrl.engines.hf"),
    "verifier": ("decentrl.verifier.main",),
    "scorer": ("decentrl.scorer.main",),
    "envd": ("decentrl.envd.main",),
}
"""What each role command imports on its way to its loop (the heavy part of its start)."""


class RoleFailed(RuntimeError):
    """A role process died or never came up; the message names its log."""


PR_SET_NAME = 15  # prctl option: the thread's name, shown by ps/top and in /proc/PID/comm


_native_threads_after_imports: int | None = None
"""OS threads of this process after its first `preload` (importing torch starts one of its own)."""
_computed_with_torch = False


def preload(commands: list[str]) -> None:
    """Import the modules of these role commands here, once, for every child forked after."""
    global _native_threads_after_imports
    for command in commands:
        for module in ROLE_MODULES.get(command, ()):
            importlib.import_module(module)
    if _native_threads_after_imports is None and not _computed_with_torch:
        _native_threads_after_imports = native_threads()


def native_threads() -> int | None:
    """This process's OS threads, native ones included (None where /proc does not tell)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def computing_with_torch() -> None:
    """Say that this process is about to compute with torch: it forks no role after that."""
    global _computed_with_torch
    _computed_with_torch = True


def can_fork() -> bool:
    """Forking is only safe in a process with one Python thread that has not computed with torch
    (see the module docstring). A thread pool that torch's OpenMP (or a tokenizer) started is
    invisible to `threading` and is told by the OS threads the process has gained since its imports:
    a launcher that evaluated a model (a second run in one process, as `bench staleness` does)
    spawns its roles instead of forking them into a pool that would never answer."""
    if not hasattr(os, "fork") or threading.active_count() != 1 or _computed_with_torch:
        return False
    native = native_threads()
    baseline = _native_threads_after_imports
    return native is None or baseline is None or native <= baseline


class ForkedProcess:
    """The part of `subprocess.Popen` a launcher uses, for a forked child."""

    def __init__(self, pid: int, args: list[str]):
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # never signal a reaped pid: it may belong to someone else now
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_call(
    name: str, run: Callable[[], int], log_fd: int, environment: dict[str, str], nice: int = 0
) -> ForkedProcess:
    """Run `run()` in a forked child whose stdout and stderr are `log_fd`; its return value is the
    child's exit status."""
    assert can_fork(), "fork before starting threads (a lock held by another thread stays held in the child)"
    sys.stdout.flush()  # what the launcher has buffered must not be written twice
    sys.stderr.flush()
    # Everything imported so far lives as long as the process: out of the collector's sight, a
    # child's full collection does not walk it, writing to every page it shares with the launcher
    # (0.3 s of copy-on-write faults in the trainer's start, measured, against 0.001 s frozen).
    gc.freeze()
    pid = os.fork()
    if pid:
        return ForkedProcess(pid, [name])
    status = 1
    try:
        _become_child(name, log_fd, environment, nice)
        status = run()
    except SystemExit as exc:  # argparse and friends
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        status = 130
    except BaseException:
        traceback.print_exc()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)  # never return into the launcher's stack (its cleanup is not ours)


def fork_role(name: str, args: list[str], log_fd: int, environment: dict[str, str]) -> ForkedProcess:
    """`decentrl ARGS` in a forked child, run as `python -m decentrl ARGS` runs it."""

    def run() -> int:
        print(f"{name}: forked from the launcher (pid {os.getppid()})", file=sys.stderr)
        sys.argv = ["decentrl", *args]
        runpy.run_module("decentrl", run_name="__main__", alter_sys=True)  # exits with the status
        return 0

    process = fork_call(name, run, log_fd, environment)
    process.args = ["decentrl", *args]
    return process


def _become_child(name: str, log_fd: int, environment: dict[str, str], nice: int) -> None:
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    # As in a fresh interpreter: streams on the new descriptors (the launcher's may be replaced
    # objects, a test runner's capture) and no logging handlers yet (the command sets its own).
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    os.environ.update(environment)
    if nice:
        os.nice(nice)
    _set_process_name(name)
    if "torch" in sys.modules:  # OpenMP read OMP_NUM_THREADS when the launcher loaded it
        import torch

        torch.set_num_threads(int(environment.get("OMP_NUM_THREADS", os.cpu_count() or 1)))


def _set_process_name(name: str) -> None:
    """`ps`, `top` and /proc/PID/comm show the role (the command line is still the launcher's)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
