"""`decentrl bench adversarial`: hostile workers against a real coordinator; detection and quarantine.

Four parts, one JSON line at the end:
1. Protocol attacks: for each, one hostile identity repeats the attack (`--attempts` times, or until
   quarantined); every attempt must be refused with a 4xx and store nothing.
2. Sampling attacks (forged log-probs, pasted reference answers, a wrong policy-version claim):
   `--trials` fresh identities each, up to `--submissions` submissions of `--groups-per-lease`
   groups; a worker that turns to pasting after `--turncoat-honest` honest submissions
   (`--turncoat-trials`); an evasion of the repeated-completion test (`--evasion-trials`); and
   `--honest-workers` honest identities for the false-quarantine rate; every identity samples on
   `--engine` in `--dtype` and declares that engine class. Rates come with exact
   one-sided 95 % Clopper-Pearson bounds. Model: the warm-started demo model; the arena publishes
   six versions (perturbations of it) and a draining trainer acks groups without training.
3. Service level (first, on a fresh coordinator; `--service-only` for just this): an honest worker's
   accepted rollouts per second alone and under idle connections (1,100 over 40 addresses), slow
   request heads, a lease hoarder, an observer replaying its captured requests and sending junk
   signatures with its token, and a worker flooding submissions that do not bind (work before
   binding), 300 slow request bodies with one worker's token over 10 addresses, four fresh
   identities hoarding leases, 4,001-rollout submissions from a worker holding one group, and
   made-up tokens from 50 addresses, each with what the attack cost per second and per honest
   rollout/s lost; the client disconnects counted (and tracebacks logged: should be 0); and the
   strikes a third party caused a key holder (should be 0).
4. Learning under attack (unless `--no-learning`): the demo with 4 workers, once all honest and once
   with one forged-log-prob worker, `--steps` trainer steps each; held-out gain ratio, and the
   verifier's compute over the trainer's (verification_overhead) at the default fraction.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks import subprocess_env
from benchmarks.adversarial.arena import Arena
from benchmarks.adversarial.attacks import (
    EVASIONS,
    PROTOCOL_ATTACKS,
    TRIAL_ATTACKS,
    flood,
    honest,
    run_trial,
    written,
)
from benchmarks.adversarial.floods import flood_figures
from benchmarks.adversarial.outsiders import service_figures
from decentrl.argparser import Parser
from decentrl.client import RequestRejected
from decentrl.config import DEMO_CONFIG, load_config


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def protocol_attacks(arena: Arena, attempts: int) -> dict:
    results = {}
    for name, attack in sorted(PROTOCOL_ATTACKS.items()):
        agent = arena.agent(name)
        accepted = detected = stored = 0
        until = None
        for index in range(attempts):
            try:
                attempt = attack(agent)
            except RequestRejected as exc:  # refused before the hostile request (e.g. the lease)
                attempt = None
                if exc.status == 403:
                    until = index
                    break
                raise
            stored += max(0, attempt.stored)  # < 0: the quarantine discarded its honest setup rollouts
            honest_claim = name == "claimed_reward" and attempt.stored == 0
            accepted += 200 <= attempt.status < 300 and not honest_claim
            detected += attempt.status >= 400 or honest_claim
            if attempt.status == 403:
                until = index
                break
        agent.close()
        results[name] = {
            "attempts": accepted + detected,
            "accepted": accepted,
            "detected": detected,
            "stored": stored,
            "submissions_until_quarantine": until,
        }
        say(f"{name}: {results[name]}")
    agent = arena.agent("flood")
    started = time.monotonic()
    served, limited = flood(agent, requests=600)
    allowance = arena.config.trust.request_burst + arena.config.trust.requests_per_second * (
        time.monotonic() - started
    )
    agent.close()
    results["request_flood"] = {
        "attempts": served + limited,
        "accepted": max(0, round(served - allowance)),
        "detected": limited,
        "stored": 0,
        "submissions_until_quarantine": None,
    }
    say(f"request_flood: {results['request_flood']} (served {served}, allowance {allowance:.0f})")
    return results


def binomial_bound(successes: int, count: int, upper: bool, confidence: float = 0.95) -> float:
    """Exact one-sided Clopper-Pearson bound of a success rate (bisection on the binomial tail)."""

    def tail(rate: float) -> float:  # P(X >= successes) for the lower bound, P(X <= successes) for the upper
        terms = range(successes, count + 1) if not upper else range(0, successes + 1)
        return sum(math.comb(count, k) * rate**k * (1 - rate) ** (count - k) for k in terms)

    if (successes == 0 and not upper) or (successes == count and upper):
        return 0.0 if not upper else 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        if upper:  # largest rate with P(X <= successes) >= 1 - confidence
            low, high = (middle, high) if tail(middle) >= 1 - confidence else (low, middle)
        else:  # smallest rate with P(X >= successes) >= 1 - confidence
            low, high = (low, middle) if tail(middle) >= 1 - confidence else (middle, high)
    return (low + high) / 2


def trials(arena: Arena, name: str, behaviour, count: int, submissions: int, groups: int, honest_before=0):
    started = time.monotonic()
    outcomes = [run_trial(arena, behaviour, submissions, groups, honest_before) for _ in range(count)]
    caught = [t.quarantined_after for t in outcomes if t.quarantined_after is not None]
    result = {
        "attempts": sum(t.submissions - honest_before for t in outcomes),
        "accepted": sum(t.rollouts_kept for t in outcomes),  # hostile rollouts that reach training
        "detected": len(caught),
        "trials": count,
        "quarantined_within_limit_rate": len(caught) / count,
        "quarantined_within_limit_rate_lower95": binomial_bound(len(caught), count, upper=False),
        "submissions_until_quarantine": statistics.mean(caught) if caught else None,
        "submissions_until_quarantine_max": max(caught) if caught else None,
        "seconds": round(time.monotonic() - started, 1),
    }
    say(f"{name}: {result}")
    return result


def honest_calibration(arena: Arena) -> dict:
    """What honest workers' verdicts showed against the tolerance their engine class is held to."""
    rows = arena.query(
        "SELECT j.verdict FROM verify_jobs j JOIN workers w ON w.worker_id = j.worker_id"
        " WHERE w.name = 'honest' AND j.state = 'done'"
    )
    verdicts = [json.loads(row[0]) for row in rows]
    largest = sorted(verdict["max_logprob_error"] for verdict in verdicts)
    tokens = sum(verdict["logprob_tokens"] for verdict in verdicts)
    detectors = arena.query(
        "SELECT r.error_detector, r.version_detector FROM reputation r"
        " JOIN workers w ON w.worker_id = r.worker_id WHERE w.name = 'honest'"
    )
    version_tokens = sum(verdict.get("version_tokens", 0) for verdict in verdicts)
    key, tolerance = arena.tolerance()
    return {
        "engine_class": key,
        "tolerance": tolerance,
        "honest_rollouts_verified": len(verdicts),
        "honest_tokens_verified": tokens,
        "max_logprob_error": largest[-1] if largest else None,
        "p99_logprob_error": largest[int(0.99 * (len(largest) - 1))] if largest else None,
        "mean_logprob_error": (
            sum(v["mean_logprob_error"] * v["logprob_tokens"] for v in verdicts) / tokens if tokens else None
        ),
        "mean_test_nats_per_token": (
            sum(v["error_log_evidence"] for v in verdicts) / tokens if tokens else None
        ),
        "highest_mean_test_detector": max((row[0] for row in detectors if row[0] is not None), default=None),
        "version_test_tokens": version_tokens,
        "version_test_nats_per_token": (
            sum(v.get("version_log_evidence", 0.0) for v in verdicts) / version_tokens
            if version_tokens
            else None
        ),
        "highest_version_test_detector": max(
            (row[1] for row in detectors if row[1] is not None), default=None
        ),
    }


def learning(model_dir: Path, run_root: Path, steps: int, hostile: bool) -> dict:
    from decentrl.launch.local import held_out_accuracy, run_roles
    from decentrl.monitor.progress import ProgressView

    # full-parameter training at 5e-4, as measured in docs/security.md (the demo now trains LoRA)
    overrides = [f"trainer.num_steps={steps}", "demo.live=false", "lora.rank=0", "trainer.lr=5e-4"]
    overrides.append(f"demo.num_workers={3 if hostile else 4}")
    config = load_config(DEMO_CONFIG, overrides)
    run_dir = run_root / ("hostile" if hostile else "honest")
    run_dir.mkdir(parents=True, exist_ok=True)
    roles: list[subprocess.Popen] = []

    def start_hostile() -> None:
        announce = run_dir / "coordinator.json"
        while not announce.is_file():
            time.sleep(0.2)
        endpoint = json.loads(announce.read_text())
        worker = config.worker.model_copy(
            update={
                "coordinator_url": endpoint["url"],
                "token": endpoint["enroll_token"],
                "name": "hostile",
                "state_dir": str(run_dir / "hostile-worker"),
            }
        )
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        log = (run_dir / "logs" / "hostile.log").open("ab")
        process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.adversarial.hostile_worker", worker.model_dump_json()],
            env=subprocess_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        roles.append(process)

    if hostile:
        threading.Thread(target=start_hostile, daemon=True).start()
    started = time.monotonic()
    stats, state = run_roles(config, run_dir, model_dir, ProgressView(enabled=False))
    for process in roles:
        process.terminate()
        process.wait(timeout=30)
    after = held_out_accuracy(config, model_dir, state)["accuracy"]
    trainer_seconds = sum(step["metrics"].get("step_seconds", 0.0) for step in stats["history"])
    result = {
        "eval_after": after,
        "rl_seconds": time.monotonic() - started,
        "verifier_seconds": stats["trust"]["compute_seconds"],
        "trainer_seconds": trainer_seconds,
        "workers_quarantined": stats["trust"]["workers_quarantined"],
        "rollouts_accepted": stats["rollouts_accepted"],
    }
    say(f"learning ({'hostile' if hostile else 'honest'}): {result}")
    return result


def arena_part(args: argparse.Namespace, model_dir: Path, root: Path) -> dict:
    """Parts 1 and 2: protocol attacks, sampling attacks, honest workers, calibration."""
    overrides = ["coordinator.max_pending_groups=4096"]
    if args.engine != "hf":  # a vLLM batch on a shared CPU can outlast the demo's 20 s lease
        overrides.append("coordinator.lease_seconds=120")
    # Two versions are all the service figures need; the sampling attacks want a longer history.
    versions = 2 if args.service_only else 6
    arena = Arena(
        model_dir,
        root / "arena",
        overrides,
        num_versions=versions,
        engine=args.engine,
        dtype=args.dtype,
        config_path=Path(args.config),
    )
    try:
        # Service level first, on a fresh coordinator: the honest rate alone and under each attack.
        report: dict = {}
        if not args.no_service:
            report["service"] = service_figures(arena, args.service_seconds)
            report["service"] |= flood_figures(arena, args.service_seconds)
            say(f"service: {report['service']}")
        if args.service_only:
            return report
        report["attacks"] = protocol_attacks(arena, args.attempts)
        for name, behaviour in sorted(TRIAL_ATTACKS.items()):
            report["attacks"][name] = trials(
                arena, name, behaviour, args.trials, args.submissions, args.groups_per_lease
            )
        report["attacks"]["turncoat"] = trials(
            arena,
            "turncoat",
            written,
            args.turncoat_trials if args.turncoat_trials is not None else max(1, args.trials // 10),
            args.submissions,
            args.groups_per_lease,
            honest_before=args.turncoat_honest,
        )
        report["evasions"] = {
            name: trials(
                arena,
                name,
                behaviour,
                args.evasion_trials if args.evasion_trials is not None else max(1, args.trials // 10),
                args.submissions,
                args.groups_per_lease,
            )
            for name, behaviour in sorted(EVASIONS.items())
        }
        started = time.monotonic()
        honest_runs = [
            run_trial(arena, honest, args.submissions, args.groups_per_lease, name="honest")
            for _ in range(args.honest_workers)
        ]
        false = sum(t.quarantined_after is not None for t in honest_runs)
        report["honest_workers"] = args.honest_workers
        report["honest_submissions_each"] = args.submissions
        report["honest_submissions"] = sum(t.submissions for t in honest_runs)
        report["honest_rollouts_stored"] = sum(arena.stored(t.worker_id) for t in honest_runs)
        report["honest_false_quarantine_rate"] = false / args.honest_workers
        report["honest_false_quarantine_rate_upper95"] = binomial_bound(
            false, args.honest_workers, upper=True
        )
        report["honest_seconds"] = round(time.monotonic() - started, 1)
        report["logprob_calibration"] = honest_calibration(arena)
        say(f"honest: {false}/{args.honest_workers} quarantined; {report['logprob_calibration']}")
    finally:
        arena.close()
    return report


def main(argv: list[str]) -> int:
    parser = Parser(prog="decentrl bench adversarial", description=__doc__)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--honest-workers", type=int, default=100)
    parser.add_argument("--submissions", type=int, default=20)
    parser.add_argument("--groups-per-lease", type=int, default=8)
    parser.add_argument("--attempts", type=int, default=10, help="per protocol attack")
    parser.add_argument("--turncoat-honest", type=int, default=30)
    parser.add_argument("--turncoat-trials", type=int, default=None, help="default: trials // 10")
    parser.add_argument("--evasion-trials", type=int, default=None, help="default: trials // 10")
    parser.add_argument("--steps", type=int, default=150, help="trainer steps of each learning run")
    parser.add_argument("--no-learning", action="store_true")
    parser.add_argument("--no-arena", action="store_true", help="only the learning part")
    parser.add_argument("--service-seconds", type=float, default=5.0, help="per service-level measurement")
    parser.add_argument("--service-only", action="store_true", help="only the service-level figures")
    parser.add_argument("--no-service", action="store_true", help="skip the service-level figures")
    parser.add_argument(
        "--engine",
        default="hf",
        choices=["hf", "vllm"],
        help="what every arena identity samples with (vllm: run from .venv-vllm)",
    )
    parser.add_argument("--dtype", default="float32", help="vllm engine dtype (float32, bfloat16)")
    parser.add_argument("--run-dir", default=None)
    parser.add_argument(
        "--config",
        default=str(DEMO_CONFIG),
        help="the run config whose model and task the arena serves (default: the demo's; "
        "configs/smollm2.toml: the real model). The learning part always runs the demo",
    )
    args = parser.parse_args(argv)
    learns = not args.no_learning and not args.service_only
    if learns and Path(args.config).resolve() != Path(DEMO_CONFIG).resolve():
        parser.error("the learning part trains the demo's model: with --config, pass --no-learning")

    from decentrl.model.resolve import resolve_model_dir

    config = load_config(Path(args.config), [])
    model_dir = resolve_model_dir(config, None)
    root = Path(args.run_dir or f"runs/bench-adversarial-{time.strftime('%Y%m%d-%H%M%S')}")
    report: dict = {"config": args.config, "model_dir": str(model_dir), "engine": args.engine}
    if not args.no_arena:
        report.update(arena_part(args, model_dir, root))
    if learns:
        from decentrl.launch.local import held_out_accuracy

        before = held_out_accuracy(config, model_dir)
        clean = learning(model_dir, root, args.steps, hostile=False)
        attacked = learning(model_dir, root, args.steps, hostile=True)
        gain_clean = clean["eval_after"] - before["accuracy"]
        gain_attacked = attacked["eval_after"] - before["accuracy"]
        report["eval_before"] = before["accuracy"]
        report["learning"] = {"honest": clean, "hostile_25pct": attacked, "steps": args.steps}
        report["improvement_ratio_with_25pct_hostile"] = gain_attacked / gain_clean if gain_clean else None
        report["verification_overhead"] = clean["verifier_seconds"] / max(clean["trainer_seconds"], 1e-9)
    print(json.dumps(report))
    return 0
