"""Isolated execution of untrusted Python (docs/sandbox.md).

`run_python` is the one entry point: it runs a program with the backend and limits of a
`SandboxConfig` and returns what happened. Backends: `bubblewrap` (the real one) and `none`
(refuses). When no backend can isolate the code, a `SandboxUnavailable` error names the fix; there
is never a silent unsandboxed fallback.
"""

from __future__ import annotations

from decentrl.config import SandboxConfig
from decentrl.sandbox.base import Program, Sandbox, SandboxResult, SandboxUnavailable
from decentrl.sandbox.bubblewrap import BubblewrapSandbox
from decentrl.sandbox.no_sandbox import NoSandbox

BACKENDS: dict[str, type[Sandbox]] = {"bubblewrap": BubblewrapSandbox, "none": NoSandbox}

__all__ = ["BACKENDS", "SandboxConfig", "SandboxResult", "SandboxUnavailable", "make_sandbox", "run_python"]


def make_sandbox(config: SandboxConfig) -> Sandbox:
    return BACKENDS[config.backend]()


def run_python(
    source: str,
    *,
    files: dict[str, str] | None = None,
    stdin: str = "",
    config: SandboxConfig | None = None,
) -> SandboxResult:
    """Run `source` as `main.py` in a fresh sandbox whose private work directory (the current
    directory, /tmp) also holds `files` (relative name -> text); `stdin` is its standard input."""
    config = config or SandboxConfig()
    return make_sandbox(config).run(Program(source=source, files=dict(files or {}), stdin=stdin), config)
