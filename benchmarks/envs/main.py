"""`decentrl bench envs`: the cost of serving environments (docs/environments.md, "Measured").

- For each environment kind (`tool_use`, a pure function served as it is; `browser`, Chromium) and
  each pool size in --instances (default 1, 4, 16): episodes/s and open/step latency p50/p99 of
  scripted episodes (the environment's own demonstrations) played by two threads per instance on
  the env server's pool (`benchmarks/envs/drive.py`).
- Memory per browser instance: PSS of an instance's process tree (the instance, Chromium and its
  renderers) after the run, per instance, and per open session.
- Failure-retry rate: the same load with a random instance SIGKILLed every --kill-every seconds on
  average: failures by reason, retries per episode, episodes/s kept.
- Coordinator cost per served rollout: the signatures and binding checked and the episode walked
  from its tokens, against the replay of a pure environment (`benchmarks/envs/checks.py`).

Progress goes to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import json
import os
import sys

from benchmarks.envs.checks import check_costs
from benchmarks.envs.drive import drive, percentile
from decentrl.argparser import Parser
from decentrl.proctree import tree_memory_bytes

KINDS = {"tool_use": {"tool_format": "python"}, "browser": {}}


def log(message: str) -> None:
    print(f"[bench envs] {message}", file=sys.stderr, flush=True)


def point(kind: str, instances: int, seconds: float, kill_every: float | None = None) -> dict:
    load, pool = drive(kind, KINDS[kind], instances, seconds, kill_every=kill_every)
    try:
        memory = [tree_memory_bytes(i.pid) for i in pool.instances if i is not None and i.alive()]
    finally:
        pool.close()
    result = {
        "instances": instances,
        "episodes": load.episodes,
        "episodes_per_s": load.episodes / load.seconds,
        "steps_per_episode": load.steps / max(1, load.episodes),
        "latency_ms_p50": 1000 * (percentile(load.latencies, 0.5) or 0.0),
        "latency_ms_p99": 1000 * (percentile(load.latencies, 0.99) or 0.0),
        "memory_mb_per_instance": sum(memory) / len(memory) / 2**20 if memory else None,
    }
    if kill_every is not None:
        result |= {
            "kills": load.kills,
            "failures": load.failures,
            "retries": load.retries,
            "retries_per_episode": load.retries / max(1, load.episodes),
            "instances_replaced": pool.counters["instances_replaced"],
        }
    log(f"{kind} x{instances}: {json.dumps(result)}")
    return result


def main(argv: list[str]) -> int:
    parser = Parser(prog="decentrl bench envs", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--instances", default="1,4,16", help="pool sizes, comma-separated")
    parser.add_argument("--seconds", type=float, default=20.0, help="load time per point")
    parser.add_argument("--kinds", default="tool_use,browser")
    parser.add_argument("--kill-every", type=float, default=2.0, help="mean seconds between two SIGKILLs")
    parser.add_argument("--kill-instances", type=int, default=4)
    parser.add_argument("--rollouts", type=int, default=200, help="rollouts for the coordinator's check cost")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.instances.split(",")]
    report: dict = {"load_average": os.getloadavg()[0], "cpus": os.cpu_count(), "kinds": {}}
    for kind in args.kinds.split(","):
        report["kinds"][kind] = {"pool": [point(kind, n, args.seconds) for n in sizes]}
        report["kinds"][kind]["killed"] = point(kind, args.kill_instances, args.seconds, args.kill_every)
    log("coordinator check cost per rollout ...")
    report["coordinator"] = check_costs(
        args.rollouts, ("browser",) if "browser" in args.kinds.split(",") else ()
    )
    report["load_average_after"] = os.getloadavg()[0]
    print(json.dumps(report))
    return 0
