"""A bounded pool of scoring processes, off the coordinator's request path.

Why not `concurrent.futures.ProcessPoolExecutor`: it cannot kill one hung call (a `9^{9^{9}}`
that sympy expands, a judge endpoint that never answers), and one crashing worker breaks the
whole executor. Here each of `size` slots owns one process and one dispatcher thread; a call that
overruns `timeout_seconds` has its process killed and replaced, a process that dies is replaced,
a result larger than `max_output_bytes` is refused unread; in each case that one call fails with
a `ScoringFailure` saying why, and the next call gets a fresh process.

Calls are queued per submitter (`key`, the worker id in the coordinator) and taken in turn by
pool time, not by arrival: the key that used the pool least so far goes next, and while others
wait (or, for a key whose last call was slow, always) no key holds more than half the processes. A submitter whose jobs run to the timeout (a
program that sleeps until the sandbox kills it) therefore delays its own jobs, not everyone's.

Processes are started with `spawn` (the coordinator has threads; forking them is unsafe), so the
scorer is built in the child from `factory`, a picklable top-level callable. Scoring runs on the
child's main thread, so `signal.alarm` based timeouts (math-verify) work. `RLIMIT_AS` bounds each
child's memory.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

log = logging.getLogger(__name__)

SLOW_CALL_SECONDS = 1.0  # a call this long (sandboxed code near its limit) marks its key as slow
START_TIMEOUT_SECONDS = 120.0  # a spawned child imports the scorer's stack (sympy, openai, ...)


class Failure(StrEnum):
    TIMEOUT = "timeout"
    CRASHED = "crashed"
    OVERSIZED = "oversized"
    ERROR = "error"
    START = "start"


@dataclass(frozen=True)
class ScoringFailure:
    kind: Failure
    detail: str


def _child(conn, factory: Callable[[], Callable[[Any], Any]], max_memory_mb: int | None) -> None:
    if max_memory_mb is not None:
        import resource

        limit = max_memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        scorer = factory()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the call
        conn.send_bytes(pickle.dumps(("start", f"{type(exc).__name__}: {exc}")))
        return
    conn.send_bytes(pickle.dumps(("ready", None)))
    while True:
        try:
            job = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        try:
            answer = ("ok", scorer(job))
        except BaseException as exc:  # noqa: BLE001 - one bad sample fails one call, not the process
            answer = ("error", f"{type(exc).__name__}: {exc}"[:500])
        conn.send_bytes(pickle.dumps(answer))


class FairQueue:
    """Jobs queued per key; `get` hands out the next job of the key that used least time so far,
    skipping a key that already holds `max_running` calls while another key waits."""

    def __init__(self, max_running: int) -> None:
        self.max_running = max_running
        self._jobs: dict[str, deque] = {}
        self._used: dict[str, float] = {}
        self.running: Counter[str] = Counter()
        self._slow: set[str] = set()
        self._ready = threading.Condition()
        self._closed = False

    def put(self, key: str, item: Any) -> None:
        with self._ready:
            self._jobs.setdefault(key, deque()).append(item)
            # a newcomer starts level with the least-used waiting key, not at zero (no banked credit)
            floor = min((self._used.get(k, 0.0) for k in self._jobs if k != key), default=0.0)
            self._used[key] = max(self._used.get(key, 0.0), floor)
            self._ready.notify()

    def get(self) -> tuple[str, Any] | None:
        """The next (key, job), waiting for one; None once closed."""
        with self._ready:
            while True:
                if self._closed:
                    return None
                key = self._pick()
                if key is not None:
                    break
                self._ready.wait()
            jobs = self._jobs[key]
            item = jobs.popleft()
            if not jobs:
                del self._jobs[key]
            self.running[key] += 1
            return key, item

    def _pick(self) -> str | None:
        # With others waiting, a key at its share of processes waits its turn; a slow key (its last
        # call took SLOW_CALL_SECONDS or more) waits even alone, so that a process stays free for
        # the next key's call instead of queueing it behind a call that sleeps to the timeout.
        crowded = len(self._jobs) > 1
        waiting = [
            key
            for key in self._jobs
            if self.running[key] < self.max_running or not (crowded or key in self._slow)
        ]
        return min(waiting, key=lambda key: self._used.get(key, 0.0), default=None)

    def done(self, key: str, seconds: float) -> None:
        with self._ready:
            self.running[key] -= 1
            if self.running[key] <= 0:
                del self.running[key]
            self._used[key] = self._used.get(key, 0.0) + seconds
            if seconds >= SLOW_CALL_SECONDS:
                self._slow.add(key)
            else:
                self._slow.discard(key)
            if key not in self._jobs and key not in self.running:
                self._used.pop(key, None)  # an idle key is forgotten: no memory grows per key
                self._slow.discard(key)
            self._ready.notify_all()

    def pending(self, key: str) -> int:
        with self._ready:
            return len(self._jobs.get(key, ())) + self.running[key]

    def __len__(self) -> int:
        with self._ready:
            return sum(len(jobs) for jobs in self._jobs.values())

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify_all()


class ScoringPool:
    def __init__(
        self,
        factory: Callable[[], Callable[[Any], Any]],
        size: int = 2,
        timeout_seconds: float = 30.0,
        max_output_bytes: int = 65536,
        max_memory_mb: int | None = None,
        start_now: bool = False,
    ) -> None:
        """`start_now`: every slot starts its process at once instead of at its first call (a
        spawned child takes a while to import its scorer; a caller who knows calls will come
        spares the first ones that wait)."""
        self.factory = factory
        self.start_now = start_now
        self.timeout_seconds = timeout_seconds
        self.max_output_bytes = max_output_bytes
        self.max_memory_mb = max_memory_mb
        self.failures: Counter[Failure] = Counter()
        self.calls = 0
        self.busy_seconds = 0.0
        self._context = multiprocessing.get_context("spawn")
        self._queue = FairQueue(max_running=max(1, size // 2))
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._slot, name=f"scoring-{i}", daemon=True) for i in range(size)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job: Any, on_seconds: Callable[[float], None] | None = None, key: str = "") -> Future:
        """Score `job` in a process; the future's result is the scorer's or a `ScoringFailure`.
        `on_seconds`, if given, is told the seconds the call held a process (not its wait in the
        queue) before the result is set: the coordinator charges them to the submitting worker.
        `key` names the submitter, whose jobs take turns with other submitters' (`FairQueue`)."""
        future: Future = Future()
        if self._closed:
            raise RuntimeError("the scoring pool is closed")
        self._queue.put(key, (job, future, on_seconds))
        return future

    def pending(self, key: str) -> int:
        """Jobs of `key` queued or being scored."""
        return self._queue.pending(key)

    def map(self, jobs: list[Any]) -> list[Any]:
        """Score every job (in parallel across the pool) and wait for all results."""
        return [future.result() for future in [self.submit(job) for job in jobs]]

    @property
    def queued(self) -> int:
        return len(self._queue)

    def close(self) -> None:
        self._closed = True
        self._queue.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def _start(self):
        parent, child = self._context.Pipe()
        process = self._context.Process(
            target=_child, args=(child, self.factory, self.max_memory_mb), daemon=True
        )
        process.start()
        child.close()
        if not parent.poll(START_TIMEOUT_SECONDS):
            _stop(process)
            return None, None, f"scorer did not start within {START_TIMEOUT_SECONDS:g}s"
        try:
            status, detail = pickle.loads(parent.recv_bytes())
        except EOFError:
            _stop(process)
            return None, None, f"scorer process died while starting (exit code {process.exitcode})"
        if status != "ready":
            _stop(process)
            return None, None, f"scorer failed to start: {detail}"
        return process, parent, ""

    def _slot(self) -> None:
        process = conn = None
        if self.start_now:
            process, conn, why = self._start()
            if process is None:  # the first call starts it again, and fails with the reason if it must
                log.warning("scorer did not start ahead of its first call: %s", why)
        while (taken := self._queue.get()) is not None:
            key, (job, future, on_seconds) = taken
            if process is None or not process.is_alive():
                process, conn, why = self._start()
                if process is None:
                    self._queue.done(key, 0.0)
                    self._finish(future, ScoringFailure(Failure.START, why), 0.0, on_seconds)
                    continue
            started = time.monotonic()
            result, healthy = self._call(process, conn, job)
            if not healthy:
                _stop(process)
                process = conn = None
            self._queue.done(key, time.monotonic() - started)
            self._finish(future, result, time.monotonic() - started, on_seconds)
        if process is not None:
            _stop(process)

    def _call(self, process, conn, job: Any) -> tuple[Any, bool]:
        """(result or failure, whether the process may be reused)."""
        conn.send_bytes(pickle.dumps(job))
        if not conn.poll(self.timeout_seconds):
            return ScoringFailure(
                Failure.TIMEOUT, f"scoring timed out after {self.timeout_seconds:g}s"
            ), False
        try:
            status, value = pickle.loads(conn.recv_bytes(maxlength=self.max_output_bytes))
        except EOFError:
            process.join(timeout=1)
            return ScoringFailure(
                Failure.CRASHED, f"scorer process died (exit code {process.exitcode})"
            ), False
        except OSError:  # recv_bytes refuses a message over maxlength without reading it
            detail = f"scoring output exceeds {self.max_output_bytes} bytes"
            return ScoringFailure(Failure.OVERSIZED, detail), False
        if status == "error":
            return ScoringFailure(Failure.ERROR, f"scorer raised {value}"), True
        return value, True

    def _finish(
        self, future: Future, result: Any, seconds: float, on_seconds: Callable[[float], None] | None
    ) -> None:
        if on_seconds is not None:
            try:
                on_seconds(seconds)
            except Exception:  # noqa: BLE001 - accounting must never lose a result
                log.exception("charging %.3fs of scoring failed", seconds)
        with self._lock:
            self.calls += 1
            self.busy_seconds += seconds
            if isinstance(result, ScoringFailure):
                self.failures[result.kind] += 1
                log.warning("scoring failed: %s", result.detail)
        future.set_result(result)


def _stop(process) -> None:
    if process.is_alive():
        process.kill()
    process.join(timeout=5)
