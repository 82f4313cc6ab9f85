"""A py-spy profile of a running process, summarised: where its CPU time goes.

`py-spy record --format raw` writes collapsed stacks (`frame;frame;... count`, root first). The
summary gives the share of samples whose innermost frame is each function (self time) and the
share of samples in which each decentrl function appears (inclusive time), top items first.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

FRAME = re.compile(r"^(?P<function>.*?) \((?P<file>[^:]*)(?::\d+)?\)$")


def short(frame: str) -> str:
    """`submit (decentrl/coordinator/ingest.py:230)` -> `decentrl/coordinator/ingest.py:submit`."""
    match = FRAME.match(frame.strip())
    if match is None:
        return frame.strip()
    path = match["file"]
    for marker in ("site-packages/", "src/", "lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{path}:{match['function']}"


def stacks(collapsed: str) -> Iterator[tuple[list[str], int]]:
    """(short frames, samples) of each line of a py-spy collapsed profile; other lines skipped."""
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            yield [short(frame) for frame in stack.split(";")], int(count)


def summarise(collapsed: str, top: int = 10) -> dict:
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for frames, samples in stacks(collapsed):
        total += samples
        own[frames[-1]] += samples
        for name in set(frames):
            if name.startswith("decentrl/"):
                inclusive[name] += samples
    share = lambda counter: [[name, round(n / max(total, 1), 3)] for name, n in counter.most_common(top)]  # noqa: E731
    return {"samples": total, "self": share(own), "decentrl_inclusive": share(inclusive)}


def executable() -> Path | None:
    """py-spy on PATH, or beside this interpreter (a virtual environment not activated)."""
    found = shutil.which("py-spy")
    beside = Path(sys.executable).with_name("py-spy")
    return Path(found) if found else beside if beside.is_file() else None


class Profiler:
    """py-spy attached to `pid` for a window that starts `delay` seconds from `start()`."""

    def __init__(self, pid: int, rate: int = 100, subprocesses: bool = False) -> None:
        self.pid = pid
        self.rate = rate
        self.subprocesses = subprocesses
        """Also sample the process's children (a coordinator's scoring pool)."""
        self.output = Path(tempfile.mkdtemp(prefix="py-spy-")) / "profile.txt"
        self.thread: threading.Thread | None = None
        self.error: str | None = None

    def start(self, delay: float, seconds: float) -> None:
        if executable() is None:
            self.error = "py-spy is not installed (pip install py-spy)"
            return
        self.thread = threading.Thread(target=self._record, args=(delay, seconds), daemon=True)
        self.thread.start()

    def _record(self, delay: float, seconds: float) -> None:
        time.sleep(delay)
        command = [
            str(executable()),
            "record",
            "--pid",
            str(self.pid),
            "--duration",
            str(int(seconds)),
            "--rate",
            str(self.rate),
            "--format",
            "raw",
            "--nonblocking",
            "--output",
            str(self.output),
            *(["--subprocesses"] if self.subprocesses else []),
        ]
        finished = subprocess.run(command, capture_output=True, text=True)
        if finished.returncode != 0:
            self.error = finished.stderr.strip()[-500:]

    def collapsed(self) -> str | None:
        """The recorded stacks once the window is over (None when py-spy failed)."""
        if self.thread is not None:
            self.thread.join(120)
        if self.error is not None or not self.output.is_file():
            return None
        return self.output.read_text()

    def summary(self) -> dict:
        if self.thread is not None:
            self.thread.join(120)
        if self.error is not None or not self.output.is_file():
            return {"error": self.error or "py-spy wrote nothing"}
        return summarise(self.output.read_text())
