"""`decentrl bench wan`: decentrl against a synchronous barrier on an emulated internet fleet.

The coordinator, trainer and verifier run on this machine's loopback, as in a data centre; the
workers reach them (and each other) through user-space proxies that add a round trip with jitter,
cap each worker's bandwidth, drop and stall connections (`link.py`). The workers run at different
speeds (CPU shares of 1:2:4:8 by default, through cgroups), a share of them behind NAT (they serve
no peer), and are killed and restarted on a seeded schedule (`fleet.py`). The same run, model,
seed and fleet is run three ways:

- `decentrl`: as it ships, with `max_staleness = --max-staleness` (8);
- `barrier`: `max_staleness = 0` and room for one batch (`max_pending_groups = groups_per_step`):
  every batch from the current version, and the trainer waits for it, as an on-policy framework
  with remote workers does;
- `nolatency`: `decentrl` with links that add nothing (run once per seed, whatever `--rtt-ms`).

Each run lasts until the trainer's held-out greedy evaluation (every `--eval-every` versions)
has reached `--threshold` and `--min-s` have passed, or `--budget-s` after version 0. Reported
per run: time from version 0 to the threshold, trained rollouts/s (steady state), the trainer's
idle share, the staleness histogram, bytes moved per version (through the proxies), and how long
a new version took to reach 90 % of the workers online at its publication (versions of the last
`--censor-s` left out). Finished runs are reused, and the summary covers every run in `--out`,
also those of earlier invocations. One JSON object on the last line of stdout; `wan.json` and
`wan.png` go to `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from benchmarks.wan.cell import Cell, run_cell
from decentrl.argparser import Parser
from decentrl.config import DEMO_CONFIG, load_config

MODES = ("decentrl", "barrier", "nolatency")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = Parser(prog="decentrl bench wan", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--config", default=None, help="run config (default: the demo's)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--rtt-ms", type=float, nargs="+", default=[50.0, 200.0, 500.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--workers", type=int, default=8, help="fleet size")
    parser.add_argument(
        "--speeds", type=float, nargs="+", default=[1, 2, 4, 8], help="relative speeds, cycled"
    )
    parser.add_argument("--fleet-cores", type=float, default=0.9, help="cores the whole fleet shares")
    parser.add_argument("--nat-share", type=float, default=0.25, help="share of workers that serve no peer")
    parser.add_argument(
        "--churn-per-minute", type=float, default=0.2, help="share of the fleet killed a minute"
    )
    parser.add_argument("--downtime-s", type=float, default=10.0, help="seconds a killed worker stays down")
    parser.add_argument("--jitter", type=float, default=0.2, help="one-way jitter as a share of the RTT")
    parser.add_argument(
        "--bandwidth-mbit", type=float, default=20.0, help="per worker link and direction (0: none)"
    )
    parser.add_argument("--drop-rate", type=float, default=0.002, help="chunks that break their connection")
    parser.add_argument("--stall-rate", type=float, default=0.005, help="chunks held --stall-s longer")
    parser.add_argument("--stall-s", type=float, default=1.0)
    parser.add_argument("--max-staleness", type=int, default=8, help="the decentrl modes' bound")
    parser.add_argument(
        "--groups-per-lease", type=int, default=None, help="default: groups_per_step / workers"
    )
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--threshold", type=float, default=0.75)
    parser.add_argument("--budget-s", type=float, default=600.0, help="a run's cap from version 0")
    parser.add_argument(
        "--min-s",
        type=float,
        default=120.0,
        help="a run lasts at least this long from version 0 (the window of its rates)",
    )
    parser.add_argument(
        "--censor-s",
        type=float,
        default=20.0,
        help="versions published this close to a run's end are left out of the reach",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/bench-wan"))
    return parser.parse_args(argv)


def cells(args: argparse.Namespace) -> list[Cell]:
    out = []
    for seed in args.seeds:
        for rtt in args.rtt_ms:
            out += [Cell(mode, rtt, seed) for mode in args.modes if mode != "nolatency"]
        if "nolatency" in args.modes:
            out.append(Cell("nolatency", 0.0, seed))
    return out


def aggregate(results: list[dict]) -> list[dict]:
    """Per (mode, RTT): the mean over seeds of each headline figure, and the seeds' values."""
    rows = []
    keys = sorted({(r["mode"], r["rtt_ms"]) for r in results}, key=lambda key: (key[1], MODES.index(key[0])))
    for mode, rtt in keys:
        runs = [r for r in results if (r["mode"], r["rtt_ms"]) == (mode, rtt)]
        row: dict = {"mode": mode, "rtt_ms": rtt, "seeds": [r["seed"] for r in runs]}
        for key in (
            "time_to_threshold_s",
            "trained_rollouts_per_second",
            "trainer_idle_share",
            "staleness_mean",
        ):
            values = [r.get(key) for r in runs]
            row[key] = values
            known = [v for v in values if v is not None]
            row[f"{key}_mean"] = (
                round(statistics.fmean(known), 3) if known and len(known) == len(values) else None
            )
        row["bytes_per_version"] = [r["bytes_per_version"] for r in runs]
        row["reach_90_median_s"] = [r["reach_90"]["median_s"] for r in runs]
        rows.append(row)
    return rows


def speedups(rows: list[dict]) -> dict:
    """decentrl's time to the threshold over the barrier's, per RTT (None if either never reached it)."""
    out = {}
    for row in rows:
        if row["mode"] != "decentrl":
            continue
        barrier = next((r for r in rows if r["mode"] == "barrier" and r["rtt_ms"] == row["rtt_ms"]), None)
        ours, theirs = row["time_to_threshold_s_mean"], barrier and barrier["time_to_threshold_s_mean"]
        out[f"{row['rtt_ms']:g}"] = round(ours / theirs, 3) if ours and theirs else None
    return out


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    base = args.config or DEMO_CONFIG
    config = load_config(base, args.overrides)
    from decentrl.model.resolve import resolve_model_dir

    model_dir = resolve_model_dir(config, None)  # the warm start is cached before any clock starts
    settings = {
        "speeds": args.speeds,
        "workers": args.workers,
        "fleet_cores": args.fleet_cores,
        "nat_share": args.nat_share,
        "churn_per_minute": args.churn_per_minute,
        "downtime_s": args.downtime_s,
        "jitter": args.jitter,
        "bandwidth_mbit": args.bandwidth_mbit,
        "drop_rate": args.drop_rate,
        "stall_rate": args.stall_rate,
        "stall_s": args.stall_s,
        "max_staleness": args.max_staleness,
        "groups_per_lease": args.groups_per_lease or math.ceil(config.trainer.groups_per_step / args.workers),
        "eval_every": args.eval_every,
        "threshold": args.threshold,
        "budget_s": args.budget_s,
        "min_s": min(args.min_s, args.budget_s),
        "censor_s": args.censor_s,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    plan = cells(args)
    for number, cell in enumerate(plan, 1):
        path = args.out / cell.name / "cell.json"
        if path.is_file():
            results.append(json.loads(path.read_text()))
            continue
        print(f"[{number}/{len(plan)}] {cell.name} ...", file=sys.stderr)
        started = time.monotonic()
        result = run_cell(cell, base, args.overrides, settings, model_dir, args.out / cell.name)
        results.append(result)
        print(
            f"  {result['time_to_threshold_s']} s to {args.threshold}, {result['trained_rollouts_per_second']} "
            f"rollouts/s, idle {result.get('trainer_idle_share')}, staleness {result['staleness_mean']} "
            f"({time.monotonic() - started:.0f} s)",
            file=sys.stderr,
        )
    # the summary covers every finished run in --out, also those of earlier invocations
    planned = {result["cell"] for result in results}
    for path in sorted(args.out.glob("*/cell.json")):
        if path.parent.name not in planned:
            results.append(json.loads(path.read_text()))
    rows = aggregate(results)
    summary = {
        "benchmark": "wan",
        "settings": settings,
        "rows": rows,
        "decentrl_over_barrier_time": speedups(rows),
        "runs": [{k: v for k, v in r.items() if k not in ("churn", "evals")} for r in results],
    }
    from benchmarks.wan.plot import plot

    summary["plot"] = str(plot(results, args.threshold, args.out / "wan.png"))
    (args.out / "wan.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}))
    return 0
