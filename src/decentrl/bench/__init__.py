"""Benchmarks behind `decentrl bench NAME [ARGS]`: one module per benchmark, each with
`main(argv: list[str]) -> int`. Each prints progress on stderr and one JSON object on the last
line of stdout, so scripts can take `tail -n 1`.

The benchmarks that attack a run (hostile workers, hostile programs) live with their harnesses in
`benchmarks/` at the root of a source checkout, outside the installed package: a wheel carries no
attack code. `run_benchmark` imports them from there when the checkout is present.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

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
}
MODULES = {
    "staleness": "decentrl.bench.staleness",
    "weights": "decentrl.bench.weights",
    "adversarial": "benchmarks.adversarial.main",
    "sandbox": "benchmarks.sandbox.main",
    "engines": "decentrl.bench.engines",
    "coordinator": "decentrl.bench.coordinator",
    "swarm": "decentrl.bench.swarm",
    "rewards": "decentrl.bench.rewards",
    "throughput": "decentrl.bench.throughput",
    "lora": "decentrl.bench.lora",
}
# src/decentrl/bench/__init__.py -> the checkout's root, where `benchmarks/` sits.
CHECKOUT = Path(__file__).resolve().parents[3]


def harnesses_importable() -> bool:
    """Make `benchmarks` importable from the source checkout; False when there is none."""
    if (CHECKOUT / "benchmarks" / "__init__.py").is_file():
        if str(CHECKOUT) not in sys.path:
            sys.path.insert(0, str(CHECKOUT))
        return True
    return importlib.util.find_spec("benchmarks") is not None


def run_benchmark(name: str, argv: list[str]) -> int:
    module = MODULES[name]
    if module.startswith("benchmarks.") and not harnesses_importable():
        raise ConfigError(
            f"`decentrl bench {name}` needs the attack harnesses in benchmarks/ of a source checkout, "
            "which this installation does not have; run it from a clone of the repository "
            "(pip install -e . there)"
        )
    return importlib.import_module(module).main(argv)
