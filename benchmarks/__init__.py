"""Benchmarks and test harnesses that attack a run, kept out of the installed package.

- `adversarial/`: hostile workers against a real coordinator (`decentrl bench adversarial`,
  tests/adversarial/): the arena, the attack catalogue, a worker process that forges log-probs.
- `sandbox/`: hostile programs against the code sandbox (`decentrl bench sandbox`, tests/sandbox/):
  their sources, the judge of each attack, the host watch that sees what escaped.

`decentrl bench NAME` finds this folder next to `src/` of a checkout (`decentrl.bench`).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def subprocess_env() -> dict[str, str]:
    """The environment for `python -m benchmarks....` in a child process: the checkout on its path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env
