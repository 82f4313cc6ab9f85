"""`decentrl bench NAME [ARGS]`: the names, and the loader of their harnesses.

The harnesses live in `benchmarks/` at the root of a source checkout, outside the installed
package: a wheel carries no benchmark or attack code. Each is a module with
`main(argv: list[str]) -> int` that prints progress on stderr and one JSON object on the last line
of stdout, so scripts can take `tail -n 1`.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

from decentrl.config import ConfigError

BENCHMARKS = {
    "staleness": "held-out accuracy vs max_staleness for each off-policy correction",
    "weights": "delta codec ratio, exactness and speed; peer fan-out speed-up",
    "adversarial": "hostile workers against a real coordinator: detection and quarantine",
    "sandbox": "sandbox throughput, attack containment and the tool-use run",
    "engines": "tokens/s, delta-apply time and mismatch KL of each inference engine",
    "coordinator": "ingestion throughput, latency per route, CPU and bytes per rollout, a profile",
    "swarm": "10,000 workers simulated: weight spread, staleness, trainer idle time, replicas needed",
    "rewards": "an RL run rewarded by math-verify, a reward model or an LLM judge: held-out before/after",
    "throughput": "the demo against an in-process synchronous loop: rollouts/s, time to accuracy, CPU by role",
    "lora": "update error per version of a LoRA run on bf16 engines: adapters merged vs served unmerged",
    "pipeline": "tokens/s of K pipeline stages over HTTP vs the whole model, by batch and RTT; codec bytes and gap",
    "envs": "served environments: episodes/s and step latency by pool size, browser memory, retries under kill -9, check cost",
    "wan": "decentrl vs a synchronous barrier on an emulated internet fleet: RTT, speeds, churn, NAT",
    "answers": "a run's held-out answers before and after RL: how much of the gain is the format lesson",
}
MODULES = {
    "staleness": "benchmarks.staleness.main",
    "weights": "benchmarks.weights.main",
    "adversarial": "benchmarks.adversarial.main",
    "sandbox": "benchmarks.sandbox.main",
    "engines": "benchmarks.engines",
    "coordinator": "benchmarks.coordinator.main",
    "swarm": "benchmarks.swarm.main",
    "rewards": "benchmarks.rewards",
    "throughput": "benchmarks.throughput.main",
    "lora": "benchmarks.lora",
    "pipeline": "benchmarks.pipeline.main",
    "envs": "benchmarks.envs.main",
    "wan": "benchmarks.wan.main",
    "answers": "benchmarks.answers",
}
ENVIRONMENT = "DECENTRL_BENCHMARKS"
"""The `benchmarks/` folder of a checkout, for an installation that is not an editable one of it."""


def candidates() -> list[Path]:
    """Where a `benchmarks/` folder is looked for, first match wins: $DECENTRL_BENCHMARKS, the
    checkout this package is installed from (`pip install -e .`: src/decentrl/bench.py -> the root),
    the current directory."""
    found = [Path(os.environ[ENVIRONMENT])] if os.environ.get(ENVIRONMENT) else []
    return [*found, Path(__file__).resolve().parents[2] / "benchmarks", Path.cwd() / "benchmarks"]


def harness_folder(module: str, places: list[Path]) -> Path | None:
    """The first of `places` that holds `module`'s file: a folder named `benchmarks` only, since
    the harnesses import each other as `benchmarks.…`."""
    relative = Path(*module.split(".")[1:]).with_suffix(".py")
    for place in places:
        place = place.resolve()
        if place.name == "benchmarks" and (place / relative).is_file():
            return place
    return None


def load_benchmark(name: str, places: list[Path] | None = None) -> ModuleType:
    """The harness module of benchmark `name`, imported from a checkout; a ConfigError naming the
    fix when no checkout is found."""
    module = MODULES[name]
    places = candidates() if places is None else places
    folder = harness_folder(module, places)
    if folder is None:
        raise ConfigError(
            f"`decentrl bench {name}` needs the harnesses in benchmarks/ of a source checkout, which "
            f"this installation does not ship and none of {', '.join(str(p) for p in places)} holds: "
            f"run it from a clone of the repository (`pip install -e .` there), or set {ENVIRONMENT} "
            "to its benchmarks/ folder"
        )
    if str(folder.parent) not in sys.path:
        sys.path.insert(0, str(folder.parent))
    return importlib.import_module(module)


def run_benchmark(name: str, argv: list[str]) -> int:
    return load_benchmark(name).main(argv)
