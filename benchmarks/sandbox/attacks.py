"""The sandbox attack suite: hostile programs and solutions, and the judgement of containment.

Shared by tests/sandbox/ (one test per attack) and `decentrl bench sandbox` (attacks_contained), so
both run the same programs and judge them the same way. A "program" attack runs as `main.py` via
`run_python`; a "solution" attack is scored by `score_solution` on a small hidden-test task and is
contained only if it scores 0. Every attack must also leave the host as it found it (see
`run_attack`). Sources are `string.Template`s filled with the bait's coordinates ($port, ...).
"""

from __future__ import annotations

import os
import re
import secrets
import string
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from benchmarks.sandbox.attack_sources import SOURCES
from benchmarks.sandbox.hostwatch import HostFixture, PeakCounter, wait_for_no_leftovers
from decentrl.config import SandboxConfig
from decentrl.envs.coding.hidden_tests import CodeScore, score_solution
from decentrl.sandbox import SandboxResult, run_python
from decentrl.sandbox.seccomp import denied_numbers

UNSEEN_EXPECTED = "9876543210123"
"""An expected value of the code task that appears nowhere the solution can look."""
CODE_TASK_TESTS = (
    f"assert add(2, 3) == 5\nassert add(-4, 1) == -3\nassert add(9876543210000, 123) == {UNSEEN_EXPECTED}\n"
)
BAIT_PARENT = "/var/tmp"
RSS_GROWTH_MB = 64.0
FINISH_WALL_SECONDS = 30.0
"""Wall clock of an attack that ends by itself (the memory bomb: 0.5-1 s alone, past 3 s beside 16
busy processes on two cores). The limit under test (address space, files, seccomp) stops it, not this."""
DISK_DROP_MB = 512.0  # other processes write to the same disk; a real leak here would be gigabytes


@dataclass(frozen=True)
class Evidence:
    config: SandboxConfig
    result: SandboxResult | None
    score: CodeScore | None

    @property
    def output(self) -> str:
        return self.result.stdout + self.result.stderr if self.result else ""

    @property
    def run(self) -> SandboxResult:
        """The program's run, for the attacks that run a program rather than score a solution."""
        assert self.result is not None, "this attack scores a solution; it has no run of its own"
        return self.result

    @property
    def scored(self) -> CodeScore:
        assert self.score is not None, "this attack runs a program; nothing was scored"
        return self.score

    def number(self, key: str) -> int | None:
        match = re.search(rf"^{key} (-?\d+)$", self.output, re.MULTILINE)
        return int(match[1]) if match else None


@dataclass(frozen=True)
class Attack:
    name: str
    goal: str
    kind: Literal["program", "solution"]
    check: Callable[[Evidence], list[str]]
    """Attack-specific failures (empty = contained); the host checks of `run_attack` come on top."""
    killed: bool = False
    """A program that runs until the sandbox kills it (CPU, wall clock). Any other program ends by
    itself and reports what it reached, so it gets `FINISH_WALL_SECONDS`: under load a short wall
    clock would kill it before its report and leave no evidence either way."""

    def run_config(self, config: SandboxConfig) -> SandboxConfig:
        """The suite's limits for this attack: its own wall clock when it must finish to report."""
        if self.kind == "solution" or self.killed:
            return config
        return config.model_copy(update={"wall_seconds": max(config.wall_seconds, FINISH_WALL_SECONDS)})

    @property
    def source(self) -> string.Template:
        return string.Template(SOURCES[self.name])


@dataclass(frozen=True)
class AttackOutcome:
    name: str
    contained: bool
    failures: list[str]
    peak_processes: int
    wall_s: float
    summary: str


def attack_config(base: SandboxConfig | None = None) -> SandboxConfig:
    """Short limits for the suite, and (for a root caller) a uid of its own so that processes the
    sandbox leaves behind can be told from other sandboxes' on the same machine."""
    base = base or SandboxConfig()
    uid = 1_000_000 + secrets.randbelow(1_000_000) if os.geteuid() == 0 else base.uid
    return base.model_copy(update={"uid": uid, "wall_seconds": 3.0, "cpu_seconds": 2})


def run_attack(attack: Attack, config: SandboxConfig) -> AttackOutcome:
    """Run one attack against bait on this host and judge: its own check, plus the host's process
    count, open files, memory, planted files, disk, bystander process and listener before and after."""
    # Not under /tmp: the sandbox's own /tmp would shadow the path and make the bait trivially absent.
    root = Path(
        tempfile.mkdtemp(prefix="decentrl-attack-", dir=BAIT_PARENT if os.path.isdir(BAIT_PARENT) else None)
    )
    config = attack.run_config(config)
    sandbox_uid = config.uid if os.geteuid() == 0 else None
    with HostFixture(root, sandbox_uid) as host:
        before = host.state()
        source = attack.source.substitute(
            host_pid=os.getpid(),
            bystander_pid=host.bystander.pid,
            port=host.port,
            tests_path=str(host.tests_path),
            run_dir=str(host.run_dir),
            root=str(root),
            denied_syscalls=repr(denied_numbers()),
        )
        with PeakCounter(host) as peak:
            if attack.kind == "program":
                evidence = Evidence(config, run_python(source, config=config), None)
            else:
                evidence = Evidence(config, None, score_solution(source, CODE_TASK_TESTS, config))
        leftovers = wait_for_no_leftovers(host)
        after = host.state()
        failures = attack.check(evidence)
        if evidence.result is not None and not attack.killed and evidence.result.timed_out:
            # its report never came: nothing shows that a limit, not the clock, stopped it
            failures.append(f"killed by the wall clock at {config.wall_seconds} s before it reported")
        if evidence.score is not None and evidence.score.reward != 0.0:
            failures.append(f"scored {evidence.score.reward} ({evidence.score.reason})")
        if host.secret in evidence.output:
            failures.append("a host secret appeared in the sandbox's output")
        if leftovers:
            failures.append(f"{len(leftovers)} sandbox processes outlived the run")
        if peak.peak > config.processes + 1:  # + bwrap's PID 1
            failures.append(f"{peak.peak} sandbox processes at once (limit {config.processes})")
        if not host.bystander_alive():
            failures.append("a host process of the sandbox's uid was killed")
        if host.connection_attempted():
            failures.append("a connection reached the host's loopback listener")
        failures += _host_changes(before, after)
    wall_s = evidence.result.wall_s if evidence.result else evidence.scored.wall_s
    summary = (
        evidence.score.reason
        if evidence.score
        else f"exit {evidence.run.exit_code}, killed {evidence.run.killed_reason}"
    )
    return AttackOutcome(attack.name, not failures, failures, peak.peak, wall_s, summary)


def _host_changes(before, after) -> list[str]:
    failures = []
    if after.children != before.children:
        failures.append(f"child processes of the host process: {before.children} -> {after.children}")
    if after.open_files != before.open_files:
        failures.append(f"open files of the host process: {before.open_files} -> {after.open_files}")
    if after.rss_mb - before.rss_mb > RSS_GROWTH_MB:
        failures.append(f"host process memory grew {after.rss_mb - before.rss_mb:.0f} MiB")
    if after.files != before.files:
        failures.append(f"host files changed: {sorted(set(after.files.items()) ^ set(before.files.items()))}")
    if before.disk_free_mb - after.disk_free_mb > DISK_DROP_MB:
        failures.append(f"host disk free space fell {before.disk_free_mb - after.disk_free_mb:.0f} MiB")
    return failures


def _killed_in_time(evidence: Evidence) -> list[str]:
    result, limit = evidence.run, evidence.config.wall_seconds
    failures = [] if result.killed_reason else ["the run ended by itself instead of being killed"]
    if result.wall_s > limit + 2.0:
        failures.append(f"ran {result.wall_s:.1f} s past a {limit} s wall clock")
    return failures


def _no_line(prefix: str) -> Callable[[Evidence], list[str]]:
    def check(evidence: Evidence) -> list[str]:
        return [line for line in evidence.output.splitlines() if line.startswith(prefix)]

    return check


def _fork_bomb(evidence: Evidence) -> list[str]:
    forks = evidence.number("forks_before_refusal")
    failures = _killed_in_time(evidence)
    if forks is None or forks >= evidence.config.processes:
        failures.append(f"forked {forks} processes under a limit of {evidence.config.processes}")
    return failures


def _memory_bomb(evidence: Evidence) -> list[str]:
    allocated = evidence.number("allocated_mb_before_refusal")
    failures = [] if "huge_refused" in evidence.output else ["a 16 GiB allocation was not refused"]
    if allocated is None or allocated >= evidence.config.address_space_mb:
        failures.append(f"allocated {allocated} MiB under a {evidence.config.address_space_mb} MiB limit")
    return failures


def _disk_fill(evidence: Evidence) -> list[str]:
    written = evidence.number("written_mb")
    failures = _no_line("wrote ")(evidence)
    if written is None or written > evidence.config.tmpfs_mb:
        failures.append(f"wrote {written} MiB into a {evidence.config.tmpfs_mb} MiB work directory")
    return failures


def _wall_clock(evidence: Evidence) -> list[str]:
    failures = _killed_in_time(evidence)
    if evidence.run.killed_reason != "wall_time":
        failures.append(f"expected the wall clock to kill it, got {evidence.run.killed_reason}")
    return failures


def _kernel_surface(evidence: Evidence) -> list[str]:
    denied = evidence.output.count("\ndenied ") + evidence.output.startswith("denied ")
    failures = _no_line("allowed ")(evidence)
    if denied + len(failures) != len(denied_numbers()):
        failures.append(f"only {denied + len(failures)} of {len(denied_numbers())} system calls were tried")
    return failures


def _unseen_expected(evidence: Evidence) -> list[str]:
    seen = UNSEEN_EXPECTED in "".join(test.detail for test in evidence.scored.tests)
    return ["the hidden expected value reached the solution"] if seen else []


ATTACKS = [
    Attack("fork_bomb", "exhaust the host's process table", "program", _fork_bomb, killed=True),
    Attack("memory_bomb", "exhaust the host's memory", "program", _memory_bomb),
    Attack(
        "infinite_loop",
        "burn CPU for ever, with a daemonized child left behind",
        "program",
        _killed_in_time,
        killed=True,
    ),
    Attack(
        "sleep_forever",
        "outlive the run without using CPU (only the wall clock can stop it)",
        "program",
        _wall_clock,
        killed=True,
    ),
    Attack("disk_fill", "fill the host's disk or memory through files", "program", _disk_fill),
    Attack("network", "reach the host's loopback or the internet", "program", _no_line("reached ")),
    Attack(
        "read_host_files",
        "read the hidden tests, the run directory, /etc/shadow",
        "program",
        _no_line("read "),
    ),
    Attack(
        "write_outside_workdir", "write to the run directory, /usr, /etc, /", "program", _no_line("wrote ")
    ),
    Attack("signal_parent", "kill the host process that runs the sandbox", "program", _no_line("signalled ")),
    Attack(
        "kernel_surface",
        "reach ptrace, mount, bpf, io_uring, keyctl, ... for an exploit",
        "program",
        _kernel_surface,
    ),
    Attack("os_exit_zero", "exit 0 before any test can fail", "solution", lambda evidence: []),
    Attack("always_equal", "return objects whose == is always True", "solution", lambda evidence: []),
    Attack(
        "forge_verdict",
        "print a passing report with the run's nonce, then exit",
        "solution",
        lambda evidence: [],
    ),
    Attack("steal_expected", "find the hidden expected values from inside", "solution", _unseen_expected),
]
ATTACKS_BY_NAME = {attack.name: attack for attack in ATTACKS}
