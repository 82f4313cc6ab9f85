"""Run one command with bounded output and a wall clock, then kill its whole process group.

Backend-neutral plumbing: stdin comes from an in-memory file (no writer thread, no pipe-buffer
deadlock), stdout and stderr are read with one selector loop that stops at a byte cap, and every
exit path ends in `killpg(SIGKILL)` so nothing the command started outlives it in its group.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

DRAIN_SECONDS = 2.0
"""After a kill, how long to wait for the pipes to close (they do when the last holder dies)."""


@dataclass(frozen=True)
class Finished:
    stdout: bytes
    stderr: bytes
    returncode: int
    timed_out: bool
    output_truncated: bool
    wall_s: float


def as_user(uid: int | None) -> dict:
    """`subprocess.Popen` arguments that run the child as `uid` with no supplementary groups
    (None: as the caller). Changing uid needs root."""
    return {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}


def memory_file(name: str, data: bytes) -> int:
    """An anonymous in-memory file holding `data`, positioned at its start (caller closes it)."""
    fd = os.memfd_create(name, 0)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def run_bounded(
    argv: Sequence[str],
    *,
    stdin_fd: int,
    pass_fds: Sequence[int],
    wall_seconds: float,
    max_output_bytes: int,
    user: int | None,
) -> Finished:
    """Run `argv` as `user` (None: unchanged) in a new session; kill its process group when the
    wall clock runs out or either output stream passes `max_output_bytes`."""
    start = time.monotonic()
    process = subprocess.Popen(
        list(argv),
        stdin=stdin_fd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=tuple(pass_fds),
        start_new_session=True,
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        **as_user(user),
    )
    assert process.stdout is not None and process.stderr is not None  # both are PIPE above
    out_fd, err_fd = process.stdout.fileno(), process.stderr.fileno()
    streams = {out_fd: bytearray(), err_fd: bytearray()}
    timed_out = truncated = False
    deadline = start + wall_seconds
    with selectors.DefaultSelector() as selector:
        for fd in streams:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                if timed_out or truncated:  # already killed; the pipes never closed: give up
                    break
                timed_out = True
                _kill_group(process)
                deadline = time.monotonic() + DRAIN_SECONDS
                continue
            for key, _ in selector.select(left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                buffer = streams[key.fd]
                buffer += chunk[: max(0, max_output_bytes - len(buffer))]
                if len(buffer) >= max_output_bytes and not truncated:
                    truncated = True
                    _kill_group(process)
                    deadline = min(deadline, time.monotonic() + DRAIN_SECONDS)
    _kill_group(process)  # whatever is left of the group goes with the command
    returncode = process.wait()
    process.stdout.close()
    process.stderr.close()
    return Finished(
        stdout=bytes(streams[out_fd]),
        stderr=bytes(streams[err_fd]),
        returncode=returncode,
        timed_out=timed_out,
        output_truncated=truncated,
        wall_s=time.monotonic() - start,
    )


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is already gone
        os.killpg(process.pid, signal.SIGKILL)
