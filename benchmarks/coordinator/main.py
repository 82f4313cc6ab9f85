"""`decentrl bench coordinator`: where one coordinator saturates under many signed workers.

The bench starts a real coordinator process on a fresh run directory (tiny model, version 0
published by the real publisher), a trainer thread that takes and acks batches through the real
client, and N simulated workers (`load.py`) in separate processes. For each rollout
length L it measures, after a warm-up: accepted rollouts/s, submissions/s, p50/p99 latency of each
route, the coordinator's CPU-seconds per accepted rollout (from /proc), the database's bytes per
rollout, and, with `--profile`, where the coordinator's CPU goes (py-spy, summarised). Two short
phases measure the CPU cost of a version check and of serving one 4 MiB weight chunk, which with
the per-token slope between the two lengths is the service-time model of `decentrl bench swarm`.
One JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.coordinator.load import load_main
from benchmarks.coordinator.server import Coordinator, start_coordinators
from benchmarks.profiling import Profiler
from decentrl.client import CoordinatorClient
from decentrl.protocol import BatchAck, BatchRequest


def trainer_loop(url: str, token: str, stop: threading.Event, counts: dict) -> None:
    """Take every ready group as the trainer does (a batch of up to 8 groups) and ack it."""
    client = CoordinatorClient(url, token, max_wait=60)
    while not stop.is_set():
        batch = client.next_batch(BatchRequest(policy_version=0, max_groups=1))
        if batch is None:
            stop.wait(0.05)
            continue
        client.ack_batch(batch.batch_id, BatchAck(policy_version=0))
        counts["groups"] += len(batch.groups)
    client.close()


def run_load(
    coordinators: list[Coordinator],
    args: argparse.Namespace,
    mode: str,
    tokens: int,
    seconds: float,
    info: dict,
    chunk: str,
) -> tuple[list, list, float, float]:
    """Load the coordinators for warm-up + `seconds`; (records in the window, errors, CPU s, window s)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    endpoint = coordinators[0].endpoint
    start = time.time() + 3.0 + args.workers * 0.02  # registration of every worker first
    window = (start + args.warmup, start + args.warmup + seconds)
    per_process = -(-args.workers // args.processes)
    processes = []
    for index in range(args.processes):
        settings = {
            "urls": [c.endpoint["url"] for c in coordinators],
            "enroll_token": endpoint["enroll_token"],
            "process": index,
            "first": index * per_process,
            "threads": min(per_process, args.workers - index * per_process),
            "start": start,
            "until": window[1],
            "mode": mode,
            "rollout_tokens": tokens,
            "info": info,
            "chunk": chunk,
        }
        process = context.Process(target=load_main, args=(settings, results), daemon=True)
        process.start()
        processes.append(process)
    time.sleep(max(0.0, window[0] - time.time()))
    cpu_before = sum(c.cpu_seconds() for c in coordinators)
    time.sleep(max(0.0, window[1] - time.time()))
    cpu = sum(c.cpu_seconds() for c in coordinators) - cpu_before
    reports = [results.get(timeout=300) for _ in processes]
    for process in processes:
        process.join(30)
    records = [r for report in reports for r in report["records"] if window[0] <= r[1] < window[1]]
    errors = [e for report in reports for e in report["errors"]]
    return records, errors, cpu, window[1] - window[0]


def latency(records: list) -> dict:
    by_route: dict[str, list[float]] = {}
    for route, _, seconds, _ in records:
        by_route.setdefault(route, []).append(seconds)
    return {
        route: {
            "p50_ms": round(float(np.percentile(v, 50)) * 1e3, 1),
            "p99_ms": round(float(np.percentile(v, 99)) * 1e3, 1),
            "count": len(v),
        }
        for route, v in sorted(by_route.items())
    }


def measure_length(args: argparse.Namespace, root: Path, tokens: int) -> dict:
    """One fresh run directory and coordinator(s) per rollout length."""
    coordinators, info, chunk = start_coordinators(root / f"L{tokens}", args, tokens)
    stop, counts = threading.Event(), {"groups": 0}
    trainer = threading.Thread(
        target=trainer_loop,
        args=(coordinators[0].endpoint["url"], coordinators[0].endpoint["trainer_token"], stop, counts),
        daemon=True,
    )
    trainer.start()
    profiler = Profiler(coordinators[0].pid, args.profile_rate) if args.profile else None
    try:
        if profiler is not None:
            profiler.start(args.warmup + 3.0 + args.workers * 0.02, args.seconds)
        records, errors, cpu, window = run_load(
            coordinators, args, "cycle", tokens, args.seconds, info, chunk
        )
        accepted = sum(r[3] for r in records)
        submissions = sum(1 for r in records if r[0] == "submit")
        result = {
            "rollout_tokens": tokens,
            "accepted_rollouts_per_second": round(accepted / window, 2),
            "submissions_per_second": round(submissions / window, 2),
            "cpu_seconds_per_accepted_rollout": round(cpu / max(accepted, 1), 5),
            "coordinator_cpu_utilisation": round(cpu / window, 2),
            "latency": latency(records),
            "errors": len(errors),
            "first_errors": errors[:3],
        }
        if profiler is not None:
            result["profile"] = profiler.summary()
        stop.set()
        trainer.join(10)
        result["groups_trained"] = counts["groups"]
        result |= coordinators[0].store_size(coordinators[0].store)
        if args.service_phases:
            records, _, cpu, window = run_load(
                coordinators, args, "poll", tokens, args.phase_seconds, info, chunk
            )
            polls = sum(1 for r in records if r[0] == "weights_latest")
            result["cpu_seconds_per_poll"] = round(cpu / max(polls, 1), 6)
            records, _, cpu, window = run_load(
                coordinators, args, "chunk", tokens, args.phase_seconds, info, chunk
            )
            chunks = sum(1 for r in records if r[0] == "weights_chunk")
            result["cpu_seconds_per_chunk"] = round(cpu / max(chunks, 1), 6)
        return result
    finally:
        stop.set()
        for coordinator in coordinators:
            coordinator.stop()


def service_model(results: list[dict], group_size: int) -> dict:
    """Per-request CPU of the swarm simulation. A submission costs a fixed part per rollout (checks,
    rows, the trainer's batch) and a part per token; a linear fit over the two lengths separates them."""
    points = [(r["rollout_tokens"], r["cpu_seconds_per_accepted_rollout"]) for r in results]
    (t0, c0), (t1, c1) = points[0], points[-1]
    slope = max(0.0, (c1 - c0) / (t1 - t0)) if t1 != t0 else c0 / t0
    poll = float(np.mean([r.get("cpu_seconds_per_poll", 0.0) for r in results]))
    # Each measured rollout also paid a share of its group's version check and lease.
    per_rollout = max(0.0, c0 - slope * t0 - 2 * poll / group_size)
    return {
        "weights_latest": poll,
        "weights_index": poll,
        "peers": poll,
        "lease": poll,
        "weights_chunk": float(np.mean([r.get("cpu_seconds_per_chunk", 0.0) for r in results])),
        "submit_per_rollout": per_rollout,
        "submit_per_token": slope,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="decentrl bench coordinator", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--workers", type=int, default=64, help="simulated workers (default 64)")
    parser.add_argument("--processes", type=int, default=2, help="load-generating processes (default 2)")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per group (default 8)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1000, 4000], help="rollout lengths")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured seconds per length")
    parser.add_argument("--warmup", type=float, default=5.0, help="unmeasured seconds first")
    parser.add_argument(
        "--store",
        default="sqlite",
        help="sqlite; postgresql (a throwaway local server); or a postgresql:// URL of a server to use",
    )
    parser.add_argument("--replicas", type=int, default=1, help="coordinator processes (PostgreSQL)")
    parser.add_argument("--profile", action="store_true", help="py-spy profile of the (first) coordinator")
    parser.add_argument("--profile-rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument(
        "--no-service-phases",
        dest="service_phases",
        action="store_false",
        help="skip the version-check and chunk phases",
    )
    parser.add_argument("--phase-seconds", type=float, default=8.0, help="seconds of each service phase")
    parser.add_argument(
        "--root", type=Path, default=None, help="where run directories go (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-coordinator-") as temp:
        root = args.root or Path(temp)
        results = []
        try:
            for tokens in args.tokens:
                print(f"bench coordinator: L={tokens}, {args.workers} workers ...", file=sys.stderr)
                results.append(measure_length(args, root, tokens))
                print(json.dumps(results[-1]), file=sys.stderr)
        finally:
            if getattr(args, "postgres_server", None) is not None:
                args.postgres_server.stop()
    summary = {
        "store": "sqlite" if args.store == "sqlite" else "postgresql",
        "replicas": args.replicas,
        "workers": args.workers,
        "group_size": args.group_size,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "lengths": results,
    }
    if args.service_phases and len(results) >= 1:
        summary["service_cpu_seconds"] = service_model(results, args.group_size)
    print(json.dumps(summary))
    return 0
