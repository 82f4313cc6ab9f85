"""What every sandbox backend returns, and the one interface they share.

A backend runs one Python program on untrusted input and reports what happened. It never decides
whether the program "passed": scoring lives in `decentrl.envs.coding.hidden_tests`, outside the sandbox.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from decentrl.config import SandboxConfig

KilledReason = Literal["wall_time", "cpu_time", "file_size", "output_limit", "signal"]


class SandboxUnavailable(RuntimeError):
    """Untrusted code cannot be run safely here; the message names the fix."""


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int
    """The program's exit status as the sandbox saw it (128 + N when killed by signal N). Written
    by untrusted code, so it proves nothing: never score on it."""
    timed_out: bool
    """The wall-clock limit was hit and the whole sandbox was killed."""
    killed_reason: KilledReason | None
    """Why the run was cut short, when it was (best effort for signals raised by rlimits)."""
    wall_s: float
    """Seconds from launch to the end of the sandbox, start-up included."""
    output_truncated: bool = False
    """stdout or stderr went past `max_output_bytes`; the run was killed and the text is cut."""


@dataclass(frozen=True)
class Program:
    """One run: `main.py` plus extra files in the private work directory, and stdin."""

    source: str
    files: dict[str, str]
    stdin: str


class Sandbox(Protocol):
    name: str

    def run(self, program: Program, config: SandboxConfig) -> SandboxResult:
        """Run `program` under `config`'s limits; raises `SandboxUnavailable` when it cannot be
        isolated, never runs it unisolated."""
        ...
