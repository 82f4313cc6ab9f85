"""`decentrl bench swarm`: the whole protocol at 10,000 workers, simulated (docs/scaling-internet.md).

For each model size (0.5B, 7B, 32B), each measured delta size (LoRA, full-parameter) and each way
of spreading weights (coordinator only, peer relay) it runs `simulation.Simulation` and reports: the
time until 90 % of the online fleet holds a new version, the staleness of trained tokens, the
trainer's idle fraction, the coordinator's request rate and CPU need (from the per-request CPU cost
that `decentrl bench coordinator` measured) and the replicas that need implies. A broadcast of one
payload to the online fleet is compared with SHARDCAST's published figure. One JSON object on the
last line; `--plot PATH` draws the figure.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.swarm import bandwidth
from benchmarks.swarm.fleet import MBIT, SNAPSHOT_RATIO, Links, SwarmConfig, Training, draw_fleet
from benchmarks.swarm.simulation import Counts, Simulation, usable_uplink
from decentrl.config import ConfigError

SIZES = (0.5, 7.0, 32.0)
# CPU-seconds of one coordinator process per request, measured by `decentrl bench coordinator`
# (SQLite, one process; docs/scaling-internet.md gives the command and the machine's load). A
# submission costs `submit_per_rollout` per rollout plus `submit_per_token` per token.
SERVICE_CPU_SECONDS = {
    "weights_latest": 0.00118,
    "weights_index": 0.00118,
    "peers": 0.00118,
    "weights_chunk": 0.00813,
    "lease": 0.00118,
    "submit_per_rollout": 0.00214,
    "submit_per_token": 2.13e-7,
}
TARGET_UTILISATION = 0.7  # a replica (one Python process, one core for the GIL) run at 70 % at most
# SHARDCAST (INTELLECT-2 report, Prime Intellect 2025): a 62 GB checkpoint reached the swarm in ~14 min.
SHARDCAST_BYTES, SHARDCAST_SECONDS = 62e9, 14 * 60


def cpu_need(counts: Counts, config: SwarmConfig, seconds: float, service: dict[str, float]) -> dict:
    """Requests per second by route, and the coordinator cores they take."""
    rates = {route: count / seconds for route, count in counts.requests.items()}
    rollouts = config.group_size * config.groups_per_lease
    per_request = {route: service[route] for route in rates if route != "submit"} | {
        "submit": rollouts
        * (service["submit_per_rollout"] + service["submit_per_token"] * config.rollout_tokens)
    }
    cores = sum(rates[route] * per_request[route] for route in rates)
    return {
        "requests_per_second": round(sum(rates.values()), 1),
        "requests_per_second_by_route": {route: round(rate, 1) for route, rate in sorted(rates.items())},
        "cpu_cores": round(cores, 2),
        "replicas": max(1, math.ceil(cores / TARGET_UTILISATION)),
    }


def summarise(simulation: Simulation, service: dict[str, float]) -> dict:
    config, counts = simulation.config, simulation.counts
    staleness = counts.trained_staleness
    trained = sum(staleness.values())
    reach = counts.reach_90_seconds
    return {
        "versions": simulation.latest,
        "batch_groups": simulation.batch_groups,
        "reach_90_seconds_median": None if not reach else round(float(np.median(reach)), 1),
        "versions_reaching_90": len(reach),
        "trained_staleness": {str(k): round(v / trained, 4) for k, v in sorted(staleness.items())}
        if trained
        else {},
        "trainer_idle_fraction": round(counts.trainer_idle_seconds / config.duration_seconds, 3),
        "worker_time_generating": round(counts.generating_seconds / counts.online_seconds, 3),
        "worker_time_fetching": round(counts.fetching_seconds / counts.online_seconds, 3),
        "accepted_groups": counts.accepted_groups,
        "rejected_stale_groups": counts.rejected_stale_groups,
        "expired_groups": counts.expired_groups,
        "lost_groups": counts.lost_groups,
        "coordinator_egress_gb": round(counts.coordinator_bytes / 1e9, 1),
        "peer_egress_gb": round(counts.peer_bytes / 1e9, 1),
        "coordinator": cpu_need(counts, config, config.duration_seconds, service),
    }


def broadcast_seconds(config: SwarmConfig, payload_bytes: float, relay: bool) -> float:
    """Seconds until 90 % of the online fleet holds one payload that nobody held (no churn)."""
    fleet = draw_fleet(config)
    online_share = fleet.session_seconds / (fleet.session_seconds + fleet.absence_seconds)
    online = np.random.default_rng(config.seed + 1).random(config.num_workers) < online_share
    down, up, serves = fleet.down[online], fleet.up[online], fleet.serves[online]
    uplink = config.coordinator_uplink_gbit * 1000 * MBIT
    remaining = np.full(down.size, payload_bytes)
    sent = 0.0
    # About 500-1,000 ticks whatever the payload: a tick is a small fraction of the finish's lower
    # bound (the median link's download, or the whole fleet's bytes through every uplink that serves).
    uplinks = uplink + (float((up * serves).sum()) if relay else 0.0)
    bound = max(payload_bytes / float(np.median(down)), 0.9 * down.size * payload_bytes / uplinks)
    dt = max(0.5, bound / 500)
    now, targets = 0.0, np.zeros(down.size, dtype=int)
    while (remaining <= 0).mean() < 0.9:
        active = remaining > 0
        want = np.minimum(down, remaining / dt) * active
        if relay:
            progress = usable_uplink(payload_bytes - remaining)
            seeds = float(up[serves & ~active].sum())
            rates, by_version = bandwidth.relay(
                want, targets, progress, {0: seeds}, up * (serves & active), uplink
            )
            sent += by_version.get(0, 0.0) * dt
            rates = np.minimum(rates, np.maximum(sent - (payload_bytes - remaining), 0.0) / dt)
        else:
            rates = bandwidth.coordinator_only(want, uplink)
        remaining -= rates * dt
        now += dt
    return now


def run_all(args: argparse.Namespace, service: dict[str, float]) -> dict:
    results: dict[str, Any] = {"runs": [], "broadcast": []}
    for params in args.sizes:
        for training in args.training:
            # The worker loop as it is, without and with peer relay; then relay with the download
            # moved behind generation (what `background_fetch` would change).
            for relay, background in ((False, False), (True, False), (True, True)):
                config = SwarmConfig(
                    num_workers=args.workers,
                    params_billion=params,
                    training=training,
                    relay=relay,
                    background_fetch=background,
                    rollout_tokens=args.rollout_tokens,
                    duration_seconds=args.duration,
                    step_seconds=args.step_seconds,
                )
                started = time.perf_counter()
                simulation = Simulation(config)
                simulation.run()
                row = {"params_billion": params, "training": training.value, "relay": relay}
                row["background_fetch"] = background
                row |= summarise(simulation, service)
                results["runs"].append(row)
                print(
                    f"{params}B {training.value} relay={relay} background={background}: {json.dumps(row)} "
                    f"({time.perf_counter() - started:.1f}s)",
                    file=sys.stderr,
                )
        config = SwarmConfig(num_workers=args.workers, params_billion=params)
        snapshot = SNAPSHOT_RATIO * config.state_bytes
        row = {"params_billion": params, "snapshot_gb": round(snapshot / 1e9, 1)}
        for relay in (False, True):
            row["relay" if relay else "coordinator_only"] = round(broadcast_seconds(config, snapshot, relay))
        results["broadcast"].append(row)
    shardcast: dict[str, Any] = {"published_seconds": SHARDCAST_SECONDS}
    results["shardcast_62gb"] = shardcast
    for links in Links:
        config = SwarmConfig(num_workers=args.workers, params_billion=32, links=links)
        shardcast[links.value] = {
            "coordinator_only_seconds": round(broadcast_seconds(config, SHARDCAST_BYTES, relay=False)),
            "relay_seconds": round(broadcast_seconds(config, SHARDCAST_BYTES, relay=True)),
        }
    return results


def read_service(path: Path) -> dict[str, float]:
    """The per-request CPU costs a `decentrl bench coordinator` run measured (its last stdout line)."""
    try:
        return json.loads(path.read_text().strip().splitlines()[-1])["service_cpu_seconds"]
    except (OSError, IndexError, ValueError, KeyError) as exc:
        raise ConfigError(
            f"--service {path}: not the output of `decentrl bench coordinator` ({exc.__class__.__name__}: "
            f"{exc}); save its last stdout line there, e.g. `decentrl bench coordinator | tail -n 1 > FILE`"
        ) from None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="decentrl bench swarm", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--workers", type=int, default=10_000, help="fleet size (default 10000)")
    parser.add_argument("--sizes", type=float, nargs="+", default=list(SIZES), help="model sizes in billions")
    parser.add_argument(
        "--training", type=Training, nargs="+", default=list(Training), help="delta sizes: lora full"
    )
    parser.add_argument("--rollout-tokens", type=int, default=1000, help="tokens per rollout (default 1000)")
    parser.add_argument("--duration", type=float, default=2400.0, help="simulated seconds per run")
    parser.add_argument("--step-seconds", type=float, default=60.0, help="trainer seconds per update")
    parser.add_argument("--service", type=Path, help="a `decentrl bench coordinator` JSON (its last line)")
    parser.add_argument("--plot", type=Path, help="write the figure here (PNG)")
    args = parser.parse_args(argv)
    service = dict(SERVICE_CPU_SECONDS)
    if args.service is not None:
        service |= read_service(args.service)
    started = time.perf_counter()
    results = run_all(args, service)
    results["workers"] = args.workers
    results["service_cpu_seconds"] = service
    results["wall_seconds"] = round(time.perf_counter() - started, 1)
    if args.plot is not None:
        from benchmarks.swarm.plot import plot

        plot(results, args.plot)
    print(json.dumps(results))
    return 0
