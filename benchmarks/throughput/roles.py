"""The processes of one arm of `decentrl bench throughput`: which role each is, the CPU time of
its process tree (from /proc), and py-spy attached to each for a window."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from benchmarks.profiling import Profiler
from decentrl.launch.fork import ROLE_MODULES

TICKS = os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []


def tree(pid: int, apart: frozenset[int] = frozenset()) -> list[int]:
    """`pid` and its live descendants, but for those in `apart` and theirs."""
    pids = [pid]
    for child in children(pid):
        if child not in apart:
            pids += tree(child, apart)
    return pids


def cpu_seconds(pid: int, apart: frozenset[int] = frozenset()) -> float:
    """User + system CPU of `pid` and its live descendants, but for those in `apart` (roles of
    their own, counted on their own) and theirs."""
    total = 0
    for member in tree(pid, apart):
        try:
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / TICKS


def role_name(pid: int) -> str | None:
    """`coordinator`, `trainer`, `verifier`, `worker-0`, ... of a `python -m decentrl ROLE` process."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError):
        return None
    if "decentrl" not in argv or argv.index("decentrl") + 1 >= len(argv):
        return None
    role = argv[argv.index("decentrl") + 1]
    if role == "demo":  # a role the demo forked keeps its command line; its name is its own
        return comm if comm.split("-")[0] in ROLE_MODULES else None
    if role == "worker" and "--name" in argv:
        return argv[argv.index("--name") + 1]
    return role


def roles(launcher: int) -> dict[str, int]:
    """The role processes a `decentrl demo` launched, by name, and the roles' own role processes
    (a colocated trainer's `trainer-sampler`)."""
    found = {}
    for pid in children(launcher):
        name = role_name(pid)
        if name is not None:
            found[name] = pid
            for child in children(pid):
                inner = role_name(child)
                if inner is not None and inner != name:
                    found[inner] = child
    return found


class Window:
    """CPU seconds and py-spy stacks of each role between `start()` and `finish()`."""

    def __init__(self, pids: dict[str, int], seconds: float, rate: int, profile: bool) -> None:
        self.pids = pids
        self.seconds = seconds
        self.profilers = (
            {name: Profiler(pid, rate, subprocesses=name == "coordinator") for name, pid in pids.items()}
            if profile
            else {}
        )
        self.cpu_before: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def start(self) -> None:
        for profiler in self.profilers.values():
            profiler.start(0.0, self.seconds)
        self.cpu_before = {name: self.cpu_seconds(pid) for name, pid in self.pids.items()}

    def cpu_seconds(self, pid: int) -> float:
        return cpu_seconds(pid, frozenset(self.pids.values()) - {pid})

    def finish(self) -> None:
        self.cpu = {name: self.cpu_seconds(pid) - self.cpu_before[name] for name, pid in self.pids.items()}


def accepted_rollouts(db_path: Path) -> int:
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=30)
    try:
        return db.execute("SELECT COUNT(*) FROM rollouts").fetchone()[0]
    finally:
        db.close()


def latest_version(db_path: Path) -> int | None:
    if not db_path.is_file():
        return None
    try:
        db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5)
        try:
            return db.execute("SELECT MAX(version) FROM train_metrics").fetchone()[0]
        finally:
            db.close()
    except sqlite3.Error:  # the coordinator is still creating its schema
        return None


def trained_by_sampler(db_path: Path) -> dict:
    """Trained rollouts of a run by who sampled them (the trainer itself or workers), and their
    mean staleness."""
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=30)
    try:
        rows = db.execute(
            "SELECT worker_id = 'trainer', COUNT(*), AVG(staleness) FROM rollouts"
            " WHERE staleness IS NOT NULL GROUP BY 1"
        ).fetchall()
    finally:
        db.close()
    counts = {"trainer" if local else "workers": count for local, count, _ in rows}
    total = sum(counts.values())
    mean = sum(count * (staleness or 0.0) for _, count, staleness in rows) / max(total, 1)
    return {"trained_by": counts, "mean_staleness": round(mean, 3)}
