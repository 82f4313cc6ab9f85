"""Host-side measurements around a sandboxed run: did anything leak onto the host?

A `HostFixture` plants what an attacker would go for (a hidden-tests file and a run directory with a
secret, a TCP listener on loopback, a bystander process running as the sandbox's own uid) and
measures the parent process (child processes, open files, resident memory), the planted files and
the processes the sandbox left behind. Used by the attack suite in tests/sandbox/ and by
`decentrl bench sandbox`, so both judge containment the same way.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from decentrl.sandbox.process import as_user


@dataclass(frozen=True)
class HostState:
    children: int
    """Processes whose parent is this process."""
    open_files: int
    """File descriptors open in this process."""
    rss_mb: float
    files: dict[str, str]
    """Planted files and anything new beside them: relative path -> sha256."""
    disk_free_mb: float


class HostFixture:
    """Bait and measurements for one attack run; use as a context manager."""

    def __init__(self, root: Path, sandbox_uid: int | None) -> None:
        self.root = root
        self.secret = secrets.token_hex(16)
        self.run_dir = root / "run"
        self.run_dir.mkdir(parents=True)
        self.tests_path = root / "hidden_tests.py"
        self.tests_path.write_text(f"assert solve() == {self.secret!r}\n")
        (self.run_dir / "store.sqlite").write_text(f"rollouts of a run {self.secret}\n")
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.bystander = subprocess.Popen(["sleep", "600"], **as_user(sandbox_uid))
        self.sandbox_uid = sandbox_uid if sandbox_uid is not None else os.getuid()

    def __enter__(self) -> HostFixture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bystander.kill()
        self.bystander.wait()
        self.listener.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def state(self) -> HostState:
        files = {
            str(path.relative_to(self.root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(self.root.rglob("*"))
            if path.is_file()
        }
        return HostState(
            children=len(_children(os.getpid())) - 1,  # minus the bystander
            open_files=len(os.listdir("/proc/self/fd")),
            rss_mb=_rss_mb(),
            files=files,
            disk_free_mb=shutil.disk_usage(self.root).free / 2**20,
        )

    def connection_attempted(self) -> bool:
        try:
            connection, _ = self.listener.accept()
        except BlockingIOError:
            return False
        connection.close()
        return True

    def bystander_alive(self) -> bool:
        return self.bystander.poll() is None

    def sandbox_processes(self) -> list[int]:
        """Live processes of the sandbox's uid inside another PID namespace than ours (the
        bystander, in ours, is excluded)."""
        own_namespace = os.readlink("/proc/self/ns/pid")
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                uid, state = _uid_and_state(entry)
                if uid != self.sandbox_uid or state == "Z":  # a zombie holds no resources; init reaps it
                    continue
                if os.readlink(f"/proc/{entry}/ns/pid") != own_namespace:
                    found.append(int(entry))
            except OSError:  # exited while we looked
                continue
        return found


class PeakCounter:
    """Samples the number of sandbox processes every few milliseconds while a run is going."""

    def __init__(self, fixture: HostFixture, interval_s: float = 0.02) -> None:
        self.fixture, self.interval_s = fixture, interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakCounter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, len(self.fixture.sandbox_processes()))
            time.sleep(self.interval_s)


def wait_for_no_leftovers(fixture: HostFixture, timeout_s: float = 2.0) -> list[int]:
    """Sandbox processes still alive after the run (PID namespace teardown takes a moment)."""
    deadline = time.monotonic() + timeout_s
    while (left := fixture.sandbox_processes()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            found += [int(child) for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:
            continue
    return found


def _uid_and_state(pid: str) -> tuple[int, str]:
    """Real uid and one-letter state (R, S, Z, ...) of a process."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["Uid"].split()[0]), fields["State"].split()[0]


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")
