"""The harnesses of `decentrl bench NAME` and of the tests that attack a run, kept out of the
installed package: each benchmark's `main(argv) -> int` is in `NAME/main.py` or `NAME.py`.

- `adversarial/`: hostile workers against a real coordinator (`decentrl bench adversarial`,
  tests/adversarial/): the arena, the attack catalogue, a worker process that forges log-probs.
- `sandbox/`: hostile programs against the code sandbox (`decentrl bench sandbox`, tests/sandbox/):
  their sources, the judge of each attack, the host watch that sees what escaped.
- `judge/`: answers that try to break out of the LLM judge (tests/reward_hacking/).
- `staleness/`, `weights/`, `coordinator/`, `swarm/`, `throughput/`, `pipeline/`, `engines.py`,
  `rewards.py`, `lora.py`: the measurements behind docs/results.md, one per `decentrl bench` name;
  `pipeline/delay_proxy.py` adds a round-trip time to any TCP link on loopback.
- `postgres_server.py` (a throwaway PostgreSQL server: the tests' store fixtures, `bench coordinator
  --store postgresql`) and `profiling.py` (a py-spy profile, summarised).

`decentrl bench NAME` (`src/decentrl/bench.py`) finds this folder next to `src/` of an editable
install, in the current directory, or at $DECENTRL_BENCHMARKS.
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
