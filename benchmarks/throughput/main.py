"""`decentrl bench throughput`: the same model, task and settings trained three ways on this
machine, back to back, from the same cached warm start and seed.

- `sync`: one process generating a lease-sized batch with the `hf` engine, scoring it with the
  coordinator's rubric and training on it with the trainer's loss and optimizer, no HTTP and no
  database (`sync.py`): the ceiling of this machine for this model;
- `demo`: `decentrl demo` as it ships (coordinator, trainer, verifier, workers on loopback);
- `demo-noverify`: the same with verification off (`trust.verify_fraction = 0`);
- `colocated`: `decentrl demo --colocate`: coordinator and a trainer that samples every group
  itself (`trainer.local_groups = groups_per_step`), no worker, on `--sync-threads` torch threads
  like the synchronous loop;
- `colocated-workers`: the same trainer with two remote workers (and the verifier) beside it.

Each arm runs for `--budget-s` seconds from its process start (the demo is then interrupted as a
user would with Ctrl-C). For each: trained rollouts/s in steady state, time from process start to
the first trained version and to `--threshold` held-out accuracy, the accuracy after the same RL
wall time for every arm, and where each role's CPU goes (py-spy, by category, over a window in
the middle of the arm) with the coordinator's CPU-seconds per accepted rollout. Every arm
evaluates greedy held-out accuracy every `--eval-every` versions inside its training loop, so
evaluation costs every arm the same. One JSON object on the last line; the accuracy-vs-wall-time
plot and each arm's raw files go to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from enum import StrEnum
from pathlib import Path

from benchmarks import subprocess_env
from benchmarks.throughput import report
from benchmarks.throughput.roles import Window, accepted_rollouts, latest_version, roles, trained_by_sampler
from decentrl.config import DEMO_CONFIG, RunConfig, load_config


class Arm(StrEnum):
    SYNC = "sync"
    DEMO = "demo"
    DEMO_NOVERIFY = "demo-noverify"
    COLOCATED = "colocated"
    COLOCATED_WORKERS = "colocated-workers"


DEFAULT_ARMS = [Arm.SYNC, Arm.DEMO, Arm.DEMO_NOVERIFY]
COLOCATED_WORKERS = 2


def arm_settings(arm: Arm, base: RunConfig, args: argparse.Namespace) -> list[str]:
    """The arm's own `--set`s over the bench's config."""
    if arm == Arm.DEMO_NOVERIFY:
        return ["trust.verify_fraction=0"]
    if arm in (Arm.COLOCATED, Arm.COLOCATED_WORKERS):
        workers = COLOCATED_WORKERS if arm == Arm.COLOCATED_WORKERS else 0
        local = base.trainer.local_groups or base.trainer.groups_per_step
        threads = args.colocated_threads or args.sync_threads
        room = max(base.coordinator.max_pending_groups, 3 * base.trainer.groups_per_step + local)
        return [
            f"trainer.local_groups={local}",
            f"coordinator.max_pending_groups={room}",  # the room a colocated trainer needs (config/checks.py)
            f"demo.num_workers={workers}",
            f"trainer.num_threads={threads}",
        ]
    return []


STOP_GRACE_S = 90.0


def arm_command(
    arm: Arm, config_path: Path, out: Path, args: argparse.Namespace, started: float
) -> list[str]:
    if arm == Arm.SYNC:
        return [sys.executable, "-m", "benchmarks.throughput.sync", str(config_path), str(out / "sync.json")] + [
            "--budget-s", str(args.budget_s), "--process-start", repr(started), "--num-threads", str(args.sync_threads)
        ]  # fmt: skip
    return [
        sys.executable,
        "-m",
        "decentrl",
        "demo",
        "--config",
        str(config_path),
        "--run-dir",
        str(out / "run"),
    ]


def arm_config(arm: Arm, args: argparse.Namespace) -> RunConfig:
    """The arm's config: the base with the bench's evaluation cadence, a step cap the budget
    reaches first, no export and no live view (its output goes to a file)."""
    base = load_config(args.config or DEMO_CONFIG, args.overrides)
    sets = [
        f"trainer.eval_every={args.eval_every}",
        f"trainer.num_steps={args.max_versions}",
        "demo.export=false",
        "demo.live=false",
        *arm_settings(arm, base, args),
    ]
    return load_config(args.config or DEMO_CONFIG, [*args.overrides, *sets])


class Progress(threading.Thread):
    """One line on stderr every few seconds: arm, time used, latest trained version."""

    def __init__(self, arm: str, out: Path, budget: float, started: float):
        super().__init__(daemon=True)
        self.arm, self.out, self.budget, self.started = arm, out, budget, started
        self.done = threading.Event()

    def latest(self) -> str:
        if self.arm == Arm.SYNC:
            log = self.out / "sync.log"
            lines = log.read_text().splitlines() if log.is_file() else []
            lines = [line for line in lines if line.startswith("sync v")]
            return lines[-1].removeprefix("sync ") if lines else "starting"
        version = latest_version(self.out / "run" / "coordinator.db")
        return "starting" if version is None else f"v{version}"

    def run(self) -> None:
        while not self.done.wait(5.0):
            elapsed = time.time() - self.started
            print(f"  [{self.arm}] {elapsed:5.0f}/{self.budget:.0f} s  {self.latest()}", file=sys.stderr)


def run_arm(arm: Arm, root: Path, args: argparse.Namespace) -> dict:
    out = root / arm
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "config.json"
    config_path.write_text(arm_config(arm, args).model_dump_json(indent=2))
    started = time.time()
    log = open(out / ("sync.log" if arm == Arm.SYNC else "demo.log"), "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        arm_command(arm, config_path, out, args, started), stdout=log, stderr=subprocess.STDOUT,
        env={**subprocess_env(), "PYTHONUNBUFFERED": "1"},  # the checkout on the sync arm's path (`-m benchmarks...`)
        # A bench started in the background (nohup, `&`) inherits SIGINT ignored, and so would the
        # demo: it is restored so that the demo stops as on Ctrl-C.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    progress = Progress(arm, out, args.budget_s, started)
    progress.start()
    window = None
    window_started = window_s = 0.0  # set with `window`
    try:
        profile_at = started + args.budget_s * (1 - args.profile_fraction) - 2.0
        while process.poll() is None and time.time() < started + args.budget_s:
            if window is None and time.time() >= profile_at and args.profile_fraction > 0:
                pids = {"sync": process.pid} if arm == Arm.SYNC else roles(process.pid)
                window = Window(pids, args.budget_s * args.profile_fraction, args.profile_rate, args.profile)
                accepted_before = 0 if arm == Arm.SYNC else accepted_rollouts(out / "run" / "coordinator.db")
                window.start()
                window_started = time.time()
            time.sleep(0.2)
        if window is not None:
            window.finish()
            window_s = time.time() - window_started
        if process.poll() is None and arm != Arm.SYNC:  # the sync loop stops itself after its version
            process.send_signal(signal.SIGINT)  # the demo stops its roles, each finishing its step
        try:
            process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            print(f"  [{arm}] did not stop within {STOP_GRACE_S:.0f} s; killed", file=sys.stderr)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        progress.done.set()
        log.close()
    if arm == Arm.SYNC:
        timeline = (
            json.loads((out / "sync.json").read_text())["timeline"] if (out / "sync.json").is_file() else []
        )
    else:
        db = out / "run" / "coordinator.db"
        timeline = report.demo_timeline(db) if db.is_file() else []
        sampled = trained_by_sampler(db) if db.is_file() else {}
    # What a version trained while the demo was stopping is past the budget: not counted.
    timeline = [point for point in timeline if point["time"] <= started + args.budget_s]
    result = report.figures(timeline, started, args.threshold)
    if arm != Arm.SYNC:
        result |= sampled
    if window is not None:
        trained = sum(
            1
            for p in timeline
            if p["version"] > 0 and window_started <= p["time"] <= window_started + window_s
        )
        result["profile"] = profile_summary(window, window_s, trained)
        if arm != Arm.SYNC:
            accepted = accepted_rollouts(out / "run" / "coordinator.db") - accepted_before
            cpu = result["profile"]["roles"].get("coordinator", {}).get("cpu_seconds", 0.0)
            result["coordinator_cpu_seconds_per_accepted_rollout"] = round(cpu / max(accepted, 1), 5)
            result["accepted_rollouts_in_window"] = accepted
    (out / "figures.json").write_text(json.dumps(result, indent=2))
    return result


def profile_summary(window: Window, seconds: float, versions: int) -> dict:
    """Per role: cores used, CPU-seconds per version trained in the window, idle share of one
    core, CPU by category; the machine's idle share."""
    out: dict = {"window_s": round(seconds, 1), "versions_in_window": versions, "roles": {}}
    for name, cpu in window.cpu.items():
        role: dict = {"cpu_seconds": round(cpu, 2), "cores": round(cpu / seconds, 2)}
        role["cpu_seconds_per_version"] = round(cpu / versions, 3) if versions else None
        role["idle"] = round(max(0.0, 1.0 - cpu / seconds), 2)
        profiler = window.profilers.get(name)
        collapsed = profiler.collapsed() if profiler is not None else None
        if collapsed is not None:
            role["categories"] = report.categorise(collapsed)
        elif profiler is not None:
            role["profile_error"] = profiler.error or "py-spy wrote nothing"
        out["roles"][name] = role
    used = sum(window.cpu.values())
    out["cpu_seconds_per_version"] = round(used / versions, 3) if versions else None
    out["machine_idle"] = round(max(0.0, 1.0 - used / (seconds * (os.cpu_count() or 1))), 2)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="decentrl bench throughput", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--config", type=Path, default=None, help="run config (default: the demo's)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override")
    parser.add_argument(
        "--arms", nargs="+", choices=list(Arm), type=Arm, default=DEFAULT_ARMS, help="arms, in this order"
    )
    parser.add_argument("--budget-s", type=float, default=90.0, help="seconds per arm from process start")
    parser.add_argument("--threshold", type=float, default=0.75, help="held-out accuracy to time")
    parser.add_argument("--eval-every", type=int, default=5, help="versions between held-out evaluations")
    parser.add_argument("--max-versions", type=int, default=100_000, help="stop an arm at this version")
    parser.add_argument("--sync-threads", type=int, default=os.cpu_count() or 1, help="torch threads (sync)")
    parser.add_argument(
        "--colocated-threads",
        type=int,
        default=None,
        help="torch threads of a colocated trainer (default: --sync-threads)",
    )
    parser.add_argument("--no-profile", dest="profile", action="store_false", help="CPU times only")
    parser.add_argument(
        "--profile-fraction", type=float, default=0.4, help="share of each arm profiled (at its end)"
    )
    parser.add_argument("--profile-rate", type=int, default=25, help="py-spy samples per second")
    parser.add_argument("--out", type=Path, default=None, help="where raw files and the plot go")
    args = parser.parse_args(argv)
    base = load_config(args.config or DEMO_CONFIG, args.overrides)
    root = args.out or Path("runs") / datetime.now().strftime("bench-throughput-%Y%m%d-%H%M%S")
    root.mkdir(parents=True, exist_ok=True)
    from decentrl.model.resolve import resolve_model_dir

    resolve_model_dir(base, None)  # the warm start is cached before any arm's clock starts
    arms: dict[str, dict] = {}
    for arm in args.arms:
        print(f"bench throughput: {arm} for {args.budget_s:.0f} s ...", file=sys.stderr)
        arms[arm] = run_arm(arm, root, args)
        shown = {k: v for k, v in arms[arm].items() if k not in ("evals", "profile")}
        print(f"  [{arm}] {json.dumps(shown)}", file=sys.stderr)
    common_rl = min((arm["rl_seconds"] for arm in arms.values() if arm.get("rl_seconds")), default=None)
    for arm in arms.values():
        arm["accuracy_at_common_rl_s"] = (
            report.accuracy_at(arm.get("evals", []), common_rl) if common_rl is not None else None
        )
    summary = {
        "config": str(args.config or "demo"),
        "budget_s": args.budget_s,
        "threshold": args.threshold,
        "eval_every": args.eval_every,
        "common_rl_s": common_rl,
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "plot": str(report.plot(arms, args.threshold, root / "accuracy_vs_wall_time.png")),
        "arms": arms,
    }
    (root / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    return 0
