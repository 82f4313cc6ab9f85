"""The bubblewrap backend: Linux namespaces, read-only system, private tmpfs, rlimits, real uid.

Layers, each with the attack it stops (measured in tests/sandbox/, docs/sandbox.md):

- a root caller first drops to `config.uid` (nobody): root ignores RLIMIT_NPROC even inside a user
  namespace (200 of 200 forks succeed under nproc=20 as root);
- `--unshare-all`: new user, PID, network, IPC, UTS and cgroup namespaces, so no network at all
  and no host process is visible or signallable; `--disable-userns` forbids nested namespaces;
- the root is an empty tmpfs holding only read-only `/usr` (and its /bin, /lib symlinks), a fresh
  /proc and a minimal /dev; `/` and `/dev` are remounted read-only after set-up, so the one
  writable place is `/tmp`, a tmpfs of `tmpfs_mb`. No /etc, /home, /root or run directory exists;
- rlimits are set by `prlimit` *inside* the namespaces: since Linux 5.14 RLIMIT_NPROC is counted
  per user namespace, so each sandbox gets its own process budget even when all run as nobody;
- a seccomp deny-list (`seccomp.py`: ptrace, mount, bpf, io_uring, keyctl, ...) narrows the
  kernel surface left to an exploit;
- `--die-with-parent` and PID namespace teardown: when the wall clock kills bwrap, its PID 1 dies
  and the kernel kills every process of the sandbox, including daemonized ones.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path, PurePosixPath

from decentrl.config import SandboxConfig
from decentrl.sandbox.base import KilledReason, Program, SandboxResult, SandboxUnavailable
from decentrl.sandbox.process import as_user, memory_file, run_bounded
from decentrl.sandbox.seccomp import deny_filter

log = logging.getLogger(__name__)
SECCOMP_FILTER = deny_filter()
if SECCOMP_FILTER is None:
    log.warning("no seccomp syscall table for %s: sandboxes run without the deny-list", platform.machine())

WORK_DIR = "/tmp"
INSTALL_HINT = "install bubblewrap (`apt-get install -y bubblewrap`; `make test` does it)"
SIGXCPU, SIGXFSZ = 24, 25


class BubblewrapSandbox:
    name = "bubblewrap"

    def run(self, program: Program, config: SandboxConfig) -> SandboxResult:
        bwrap = _check_available(config.python, _sandbox_uid(config))
        placed = {"main.py": program.source, **program.files}
        fds: list[int] = []
        try:
            file_args: list[str] = []
            for directory in _parent_dirs(placed):
                file_args += ["--dir", f"{WORK_DIR}/{directory}"]
            for name, text in placed.items():
                fds.append(memory_file(name, text.encode()))
                file_args += ["--file", str(fds[-1]), f"{WORK_DIR}/{name}"]
            # bwrap writes {"exit-code": N} here only if the sandbox was set up and the program ran.
            fds.append(status_fd := os.memfd_create("bwrap-status", 0))
            argv = [bwrap, *_isolation_args(config), *file_args, "--remount-ro", "/dev", "--remount-ro", "/"]
            argv += ["--json-status-fd", str(status_fd)]
            if SECCOMP_FILTER is not None:
                fds.append(filter_fd := memory_file("seccomp", SECCOMP_FILTER))
                argv += ["--seccomp", str(filter_fd)]
            argv += ["--", *_limited(config), config.python, "-I", "-S", "-B", "-X", "utf8", "main.py"]
            fds.append(stdin_fd := _read_only(memory_file("stdin", program.stdin.encode())))
            finished = run_bounded(
                argv,
                stdin_fd=stdin_fd,
                pass_fds=fds[:-1],
                wall_seconds=config.wall_seconds,
                max_output_bytes=config.max_output_bytes,
                user=_sandbox_uid(config),
            )
            set_up = b'"exit-code"' in os.pread(status_fd, 65536, 0)
        finally:
            for fd in fds:
                os.close(fd)
        if not (set_up or finished.timed_out or finished.output_truncated):
            # An infrastructure failure (e.g. no user namespaces left) must not pass as a program
            # that failed its tests: that would silently score every solution 0.
            raise SandboxUnavailable(
                f"bwrap could not set up the sandbox: {finished.stderr.decode(errors='replace').strip()[:500]}"
            )
        # bwrap reports a program killed by signal N as 128 + N; bwrap itself killed by us is -N.
        exit_code = 128 - finished.returncode if finished.returncode < 0 else finished.returncode
        return SandboxResult(
            stdout=finished.stdout.decode(errors="replace"),
            stderr=finished.stderr.decode(errors="replace"),
            exit_code=exit_code,
            timed_out=finished.timed_out,
            killed_reason=_killed_reason(exit_code, finished.timed_out, finished.output_truncated),
            wall_s=finished.wall_s,
            output_truncated=finished.output_truncated,
        )


def _read_only(fd: int) -> int:
    """A read-only descriptor of the same file (the program cannot write into our memory file)."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    finally:
        os.close(fd)


def _isolation_args(config: SandboxConfig) -> list[str]:
    args = ["--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session"]
    args += ["--clearenv", "--setenv", "PATH", "/usr/bin", "--setenv", "HOME", WORK_DIR]
    args += ["--setenv", "LANG", "C.UTF-8", "--hostname", "sandbox"]
    args += [*_system_args(), "--proc", "/proc", "--dev", "/dev"]
    args += ["--size", str(config.tmpfs_mb << 20), "--tmpfs", WORK_DIR, "--chdir", WORK_DIR]
    return args


def _system_args() -> list[str]:
    """Read-only /usr, plus the /bin, /lib, ... links of a merged-/usr system (Debian 12)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for link in ("bin", "lib", "lib64", "sbin"):
        if Path(f"/{link}").is_symlink():
            args += ["--symlink", os.readlink(f"/{link}"), f"/{link}"]
    return args


def _limited(config: SandboxConfig) -> list[str]:
    """`prlimit` run as the sandbox's first program, so the limits bind every later process."""
    return [
        "/usr/bin/prlimit",
        f"--cpu={config.cpu_seconds}:{config.cpu_seconds + 1}",  # SIGXCPU, then SIGKILL a second later
        f"--as={config.address_space_mb << 20}",
        f"--fsize={config.file_size_mb << 20}",
        f"--nofile={config.open_files}",
        f"--nproc={config.processes}",
        "--core=0",
        "--",
    ]


def _parent_dirs(placed: dict[str, str]) -> list[str]:
    """Directories to create for nested file names, parents first; rejects names that escape."""
    directories: set[str] = set()
    for name in placed:
        path = PurePosixPath(name)
        if path.is_absolute() or not path.parts or ".." in path.parts or name != str(path):
            raise ValueError(f"sandbox file name {name!r} must be a plain relative path like 'pkg/util.py'")
        directories.update(str(parent) for parent in path.parents if str(parent) != ".")
    return sorted(directories, key=lambda d: d.count("/"))


def _sandbox_uid(config: SandboxConfig) -> int | None:
    """The uid to drop to: only a root caller changes uid (anyone else is already unprivileged)."""
    return config.uid if os.geteuid() == 0 else None


def _killed_reason(returncode: int, timed_out: bool, truncated: bool) -> KilledReason | None:
    if truncated:
        return "output_limit"
    if timed_out:
        return "wall_time"
    if returncode == 128 + SIGXCPU:
        return "cpu_time"
    if returncode == 128 + SIGXFSZ:
        return "file_size"
    if 128 < returncode <= 128 + 64:
        return "signal"  # includes the SIGKILL of RLIMIT_CPU's hard limit
    return None


@functools.lru_cache(maxsize=8)
def _check_available(python: str, uid: int | None) -> str:
    """Path of bwrap after one trial run; a clear `SandboxUnavailable` otherwise (cached)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(f"refusing to run untrusted code: bwrap not found; {INSTALL_HINT}")
    if not python.startswith("/usr/") or not os.access(python, os.X_OK):
        raise SandboxUnavailable(
            f"sandbox.python {python!r} is not an executable under /usr (the only host tree the sandbox "
            "mounts); install python3 from the system packages or point sandbox.python at one"
        )
    trial = subprocess.run(
        [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", *_system_args(), "/usr/bin/true"],
        capture_output=True,
        text=True,
        timeout=30,
        **as_user(uid),
    )
    if trial.returncode != 0:
        raise SandboxUnavailable(
            f"refusing to run untrusted code: bwrap cannot create namespaces here ({trial.stderr.strip()}); "
            "enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1) or run on a "
            "host that allows them"
        )
    return bwrap
