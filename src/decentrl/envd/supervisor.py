"""The env server's pool of instances: child processes with a deadline per request and a memory cap.

Each `Instance` is `python -m decentrl.envd.instance` hosting up to `sessions_per_instance` live
episodes of one environment (`envd/instance.py`). Requests to one instance run one at a time. A
request that gets no answer within `step_seconds` is a timeout; a child that exits, or closes its
pipe, a crash; a process tree (the child and everything it started, a browser's renderers too)
over `memory_mb` of PSS after a request, a memory failure. Any of them kills the whole tree, and
the slot gets a fresh instance at once: every episode the old one held is failed with that reason
(`InstanceFailed`), never left half-alive. An `error` answer (the environment raised on one
episode) fails that episode only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import IO

from decentrl.envd_wire import EnvFailure
from decentrl.proctree import kill_tree, tree_memory_bytes

log = logging.getLogger(__name__)

MEMORY_CHECK_EVERY = 8
"""Requests between two measurements of an instance's memory (reading /proc costs a few ms)."""


class InstanceFailed(Exception):
    def __init__(self, failure: EnvFailure, detail: str):
        super().__init__(f"{failure.value}: {detail}")
        self.failure = failure
        self.detail = detail


@dataclass(frozen=True)
class Limits:
    step_seconds: float
    start_seconds: float
    memory_bytes: int
    sessions: int


class Instance:
    def __init__(self, slot: int, env: str, args: dict, limits: Limits, stderr: IO | None = None):
        self.slot = slot
        self.limits = limits
        self.sessions: set[str] = set()
        self.lock = threading.Lock()
        self.requests = 0
        self.failed: InstanceFailed | None = None
        """Set once the instance died: every later request of its sessions fails with it."""
        command = [sys.executable, "-m", "decentrl.envd.instance", json.dumps({"env": env, "args": args})]
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            start_new_session=True,
            text=True,
            bufsize=1,
        )
        self.pid = self.process.pid
        hello = self._read(limits.start_seconds, "start")
        self.version = str(hello["version"])

    def _read(self, timeout: float, what: str) -> dict:
        stdout = self.process.stdout
        assert stdout is not None
        if not select.select([stdout], [], [], timeout)[0]:
            raise InstanceFailed(
                EnvFailure.TIMEOUT, f"instance {self.slot}: no answer to {what} in {timeout:.0f} s"
            )
        line = stdout.readline()
        if not line:
            code = self.process.poll()
            raise InstanceFailed(
                EnvFailure.CRASH, f"instance {self.slot} exited (status {code}) during {what}"
            )
        return json.loads(line)

    def call(self, request: dict) -> dict:
        """The instance's answer; InstanceFailed (the instance is dead then) or, for an `error`
        answer, InstanceFailed(ERROR) with the instance still serving its other sessions."""
        with self.lock:
            if self.failed is not None:
                raise self.failed
            try:
                assert self.process.stdin is not None
                self.process.stdin.write(json.dumps(request) + "\n")
                self.process.stdin.flush()
                answer = self._read(self.limits.step_seconds, request["op"])
                self.requests += 1
                if self.requests % MEMORY_CHECK_EVERY == 0 or request["op"] == "open":
                    used = tree_memory_bytes(self.pid)
                    if used > self.limits.memory_bytes:
                        raise InstanceFailed(
                            EnvFailure.MEMORY,
                            f"instance {self.slot} takes {used >> 20} MiB, over {self.limits.memory_bytes >> 20}",
                        )
            except (BrokenPipeError, OSError, ValueError) as exc:
                self._die(InstanceFailed(EnvFailure.CRASH, f"instance {self.slot}: {exc}"))
                raise self.failed from None  # type: ignore[misc]
            except InstanceFailed as failed:
                self._die(failed)
                raise
        if "error" in answer:
            if answer.get("fatal"):
                self._die(InstanceFailed(EnvFailure.CRASH, str(answer["error"])))
                raise self.failed  # type: ignore[misc]
            raise InstanceFailed(EnvFailure.ERROR, str(answer["error"]))
        return answer

    def _die(self, failure: InstanceFailed) -> None:
        self.failed = failure
        self.kill()

    def kill(self) -> None:
        kill_tree(self.pid)
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):  # unflushed bytes for a reader that is gone
                    pipe.close()

    def alive(self) -> bool:
        return self.failed is None and self.process.poll() is None


class Pool:
    """`size` instances of one environment; a dead one is replaced at the next request for room."""

    def __init__(self, env: str, args: dict, size: int, limits: Limits, stderr: IO | None = None):
        self.env, self.args, self.limits, self.stderr = env, args, limits, stderr
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.instances: list[Instance | None] = [None] * size
        for slot in range(size):
            self.instances[slot] = self._start(slot)
        first = self.instances[0]
        assert first is not None
        self.version = first.version

    def _start(self, slot: int) -> Instance:
        started = time.monotonic()
        instance = Instance(slot, self.env, self.args, self.limits, self.stderr)
        self.counters["instances_started"] += 1
        log.info(
            "instance %d: pid %d, %s, ready in %.2f s",
            slot,
            instance.pid,
            instance.version,
            time.monotonic() - started,
        )
        return instance

    def place(self, session: str) -> Instance:
        """An instance with room for one more session (dead ones are replaced first); InstanceFailed
        (TIMEOUT) when all are full, CRASH when no fresh instance starts."""
        with self._lock:
            for slot, instance in enumerate(self.instances):
                if instance is None or not instance.alive():
                    if instance is not None:
                        self.counters["instances_replaced"] += 1
                        log.warning("instance %d replaced: %s", slot, instance.failed or "it exited")
                        instance.kill()
                    try:
                        self.instances[slot] = self._start(slot)
                    except InstanceFailed:
                        self.instances[slot] = None
                        raise
            free = [i for i in self.instances if i is not None and len(i.sessions) < self.limits.sessions]
            if not free:
                raise InstanceFailed(EnvFailure.TIMEOUT, f"all {len(self.instances)} instances are full")
            instance = min(free, key=lambda i: len(i.sessions))
            instance.sessions.add(session)
            return instance

    def release(self, instance: Instance, session: str) -> None:
        with self._lock:
            instance.sessions.discard(session)

    @property
    def capacity(self) -> int:
        return len(self.instances) * self.limits.sessions

    def open_sessions(self) -> int:
        return sum(len(i.sessions) for i in self.instances if i is not None)

    def close(self) -> None:
        with self._lock:
            for instance in self.instances:
                if instance is not None:
                    instance.kill()
