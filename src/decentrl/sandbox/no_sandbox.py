"""The explicit "no sandbox" backend: it refuses. Untrusted code never runs unisolated, so a
machine without a working sandbox fails loudly instead of silently executing model output."""

from __future__ import annotations

from decentrl.config import SandboxConfig
from decentrl.sandbox.base import Program, SandboxResult, SandboxUnavailable


class NoSandbox:
    name = "none"

    def run(self, program: Program, config: SandboxConfig) -> SandboxResult:
        raise SandboxUnavailable(
            "refusing to run untrusted code: sandbox.backend is 'none'; install bubblewrap "
            "(`apt-get install -y bubblewrap`) and set sandbox.backend='bubblewrap'"
        )
