"""A process and everything below it, from /proc (Linux): what an env server measures and kills.

An environment instance may fork helpers that leave its process group (a browser starts its own
session), so its memory and its teardown follow the parent links instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (children of children...), from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # a process that exited meanwhile
            parents.setdefault(parent, []).append(int(entry.name))
    found, frontier = [pid], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in parents.get(parent, [])]
        found += frontier
    return found


def tree_memory_bytes(pid: int) -> int:
    """Proportional set size (PSS) of `pid` and its descendants: what a browser and its renderers
    really take (RSS would count their shared pages once per process)."""
    total = 0
    for process in descendants(pid):
        try:
            for line in Path(f"/proc/{process}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) << 10
                    break
        except (OSError, IndexError, ValueError):
            continue
    return total


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every descendant (listed first, so none is orphaned to init unseen)."""
    for process in reversed(descendants(pid)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(process, signal.SIGKILL)
