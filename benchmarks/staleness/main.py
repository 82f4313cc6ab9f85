"""`decentrl bench staleness`: how much staleness each off-policy correction tolerates.

Each cell is a real run of the demo's roles (coordinator, trainer, two workers on loopback) from
the same cached warm start, at one `max_staleness` k, with one correction, for one RL seed.
Staleness is made to happen, not just allowed: every worker leases 8·k groups at once and holds
its finished rollouts for `delay_per_version · k` seconds before submitting (a far-away worker
with a slow link), and `max_pending_groups` = groups_per_step · (k + 1) lets k batches be in
flight. The realised staleness histogram of every cell is reported next to its accuracy.

Per cell: final held-out greedy accuracy (mean of the last three in-run evaluations of 200
problems plus the final one of 256, to damp evaluation noise) and the time (versions and trainer
seconds) to first reach `--target` accuracy.

With `--config RUN.toml` the cells run that config instead of the demo's (e.g. the real model,
configs/smollm2.toml): its batch shape, learning rate, LoRA rank, evaluation cadence and correction
stay as it sets them unless a flag names them; only the bound k, the in-flight room
(groups_per_step · (k + 1) groups) and the seed change. No submit delay is added by default: a real
model's worker generates far ahead of its trainer, so the queue fills to the bound by itself.

Prints one JSON object on the last stdout line and writes `study.json` and `staleness.png` into
the output directory. Finished cells are reused, so an interrupted study resumes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.staleness.table import aggregate, breakdowns, headline
from decentrl.argparser import Parser

# A cell's correction, optionally with loss options: "none+dual_clip" is naive PPO (clip centred
# on the worker's mu) with INTELLECT-2's two-sided clip c = 3 (arXiv 2505.07291; algorithms.md §2.5);
# "m2po+with_advantage" masks only tokens that moved the way their advantage pushes, as the M2PO
# authors' released code does.
VARIANTS = {
    "none": [],
    "none+dual_clip": ["algorithm.loss.dual_clip=3.0"],
    "tis": [],
    "decoupled": [],
    "m2po": [],
    "m2po+with_advantage": ["algorithm.correction.tokens=with_advantage"],
}
CORRECTIONS = list(VARIANTS)
CONFIG_CORRECTION = "config"  # with --config and no --corrections: the config's own correction
FULL = {"staleness": [0, 1, 2, 4, 8, 16], "corrections": CORRECTIONS, "seeds": [0, 1, 2]}
QUICK = {"staleness": [0, 8], "corrections": CORRECTIONS, "seeds": [0]}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = Parser(prog="decentrl bench staleness", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one seed, staleness 0 and 8 (under 15 min)")
    parser.add_argument(
        "--config",
        help="run config for every cell (default: the demo's, with the study's batch shape); "
        "its own batch shape, lr, LoRA rank and correction are kept unless a flag names them",
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="config override for every cell"
    )
    parser.add_argument(
        "--staleness", type=int, nargs="+", help="max_staleness values (default 0 1 2 4 8 16)"
    )
    parser.add_argument(
        "--corrections",
        nargs="+",
        choices=CORRECTIONS,
        help=f"cells' corrections (default: {' '.join(CORRECTIONS)})",
    )
    parser.add_argument("--seeds", type=int, nargs="+", help="RL seeds (default 0 1 2)")
    parser.add_argument("--num-steps", type=int, help="policy versions per run (default 200; quick 150)")
    parser.add_argument(
        "--lr",
        type=float,
        help="trainer learning rate (default 5e-4 / minibatches: full-parameter AdamW moves a "
        "version about as far with four steps at 1.25e-4 as with one at 5e-4)",
    )
    parser.add_argument(
        "--minibatches",
        type=int,
        help="optimizer steps per version (default 4, the trainer's default; docs/staleness.md "
        "also has the study with 1)",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        help="LoRA rank (default 0: full-parameter training, as the study in docs/staleness.md)",
    )
    parser.add_argument(
        "--delay-per-version",
        type=float,
        help="worker submit delay per unit of k (s; default 0.1 on the demo, 0 with --config)",
    )
    parser.add_argument("--target", type=float, default=0.75, help="accuracy whose first crossing is timed")
    parser.add_argument("--out", default=None, help="output directory (default runs/bench-staleness)")
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="STUDY_JSON",
        help="pool the cells of finished studies (same versions, lr, mini-batches and LoRA rank; "
        "a cell in a later file replaces the same cell in an earlier one) into --out's study.json, "
        "staleness.png and seeds.png, and run nothing",
    )
    args = parser.parse_args(argv)
    if args.config is None:  # the demo study's shape (docs/staleness.md)
        args.minibatches = args.minibatches or 4
        args.lora_rank = args.lora_rank or 0
        args.lr = args.lr or 5e-4 / args.minibatches
        args.delay_per_version = 0.1 if args.delay_per_version is None else args.delay_per_version
    else:
        args.delay_per_version = args.delay_per_version or 0.0
        if not Path(args.config).is_file():
            parser.error(f"--config {args.config}: no such file")
    if args.config is not None or args.overrides:  # a bad file or override: one line, before any cell
        from decentrl.config import load_config

        load_config(base_config_path(args), list(args.overrides))
    return args


def base_config_path(args: argparse.Namespace) -> str:
    from decentrl.config import DEMO_CONFIG

    return str(args.config or DEMO_CONFIG)


def config_cell_overrides(k: int, correction: str | None, seed: int, args: argparse.Namespace) -> list[str]:
    """A cell of a run config's own shape: the bound, the room for k + 1 batches in flight, the
    seed and the flags the user named; the config's correction when `correction` is None."""
    from decentrl.config import load_config

    base = load_config(args.config, list(args.overrides))
    overrides = bound_overrides(k, base.trainer.groups_per_step, seed, args)
    if args.num_steps is not None:
        overrides.append(f"trainer.num_steps={args.num_steps}")
    for flag, key in (
        ("lr", "trainer.lr"),
        ("minibatches", "trainer.minibatches_per_version"),
        ("lora_rank", "lora.rank"),
    ):
        if getattr(args, flag) is not None:
            overrides.append(f"{key}={getattr(args, flag)}")
    if correction is not None:
        overrides += correction_overrides(correction)
    return [*args.overrides, *overrides]


def bound_overrides(k: int, groups_per_step: int, seed: int, args: argparse.Namespace) -> list[str]:
    """What every cell sets: its seed, the bound k with room for k + 1 batches in flight, the
    worker's submit delay, and no live view or export (a cell is judged on its in-run and final
    greedy evaluations only)."""
    return [
        f"seed={seed}",
        f"coordinator.max_staleness={k}",
        f"coordinator.max_pending_groups={groups_per_step * (k + 1)}",
        f"worker.delay_seconds={args.delay_per_version * k}",
        "demo.live=false",
        "demo.export=false",
    ]


def correction_overrides(correction: str) -> list[str]:
    """The correction alone (dropping a config file's fields of another one) and its loss options."""
    return [f"algorithm.correction={{name = '{correction.split('+')[0]}'}}", *VARIANTS[correction]]


def cell_overrides(k: int, correction: str, seed: int, args: argparse.Namespace) -> list[str]:
    if args.config is not None:
        return config_cell_overrides(k, None if correction == CONFIG_CORRECTION else correction, seed, args)
    groups_per_step = 16
    return [
        *args.overrides,
        *bound_overrides(k, groups_per_step, seed, args),
        "model.seed=0",  # every cell starts from the same warm start; only the RL seed varies
        "coordinator.lease_seconds=120",
        f"worker.groups_per_lease={max(8, 8 * k)}",
        f"trainer.groups_per_step={groups_per_step}",
        f"trainer.num_steps={args.num_steps}",
        f"trainer.lr={args.lr}",
        f"lora.rank={args.lora_rank}",
        f"trainer.minibatches_per_version={args.minibatches}",
        "trainer.eval_every=25",
        *correction_overrides(correction),
    ]


def first_crossing(history: list[dict], target: float) -> tuple[int | None, float | None]:
    for step in history:
        metrics = step["metrics"]
        if metrics.get("eval_accuracy", -1.0) >= target:
            return step["policy_version"], metrics.get("elapsed_seconds")
    return None, None


def _window_mean(history: list[dict], key: str, first: int, last: int) -> float | None:
    values = [
        step["metrics"][key]
        for step in history
        if key in step["metrics"] and first <= step["policy_version"] <= last
    ]
    return round(statistics.fmean(values), 4) if values else None


# M2PO's per-version mask statistics (algo/corrections): M2 of log(pi_prox / mu) over the batch,
# the fraction of loss tokens masked, their share of the batch's |A|, and the fraction of masked
# tokens with A != 0 that had moved against their advantage (whose gradient pulls the policy back)
M2PO_STATS = {
    "m2_mean": "m2",
    "masked_token_fraction_mean": "is_rejected_fraction",
    "masked_advantage_share_mean": "is_rejected_advantage_share",
    "masked_corrective_fraction_mean": "is_rejected_corrective_fraction",
}
M2PO_EARLY = 100  # the mask's two regimes in the study: drifting policy, then settled


def cell_diagnostics(history: list[dict], correction: str) -> dict:
    """What happened on the way to a cell's final accuracy: the in-run evaluation curve, its
    lowest point, the peak trainer/sampler mismatch KL, the mean clip fraction and, for M2PO,
    the mask's statistics over versions 0-100 and after."""
    curve = [
        [step["policy_version"], round(step["metrics"]["eval_accuracy"], 4)]
        for step in history
        if "eval_accuracy" in step["metrics"]
    ]
    kls = [step["metrics"]["mismatch_kl"] for step in history if "mismatch_kl" in step["metrics"]]
    clip = [step["metrics"]["clip_fraction"] for step in history if "clip_fraction" in step["metrics"]]
    out: dict = {
        "eval_curve": curve,
        "lowest_eval": min((accuracy for _, accuracy in curve), default=None),
        "peak_mismatch_kl": round(max(kls), 4) if kls else None,
        "clip_fraction_mean": round(statistics.fmean(clip), 4) if clip else None,
    }
    if correction.startswith("m2po"):
        last = max((step["policy_version"] for step in history), default=0)
        for first, end in ((0, M2PO_EARLY), (M2PO_EARLY + 1, last)):
            stats = {name: _window_mean(history, key, first, end) for name, key in M2PO_STATS.items()}
            if any(value is not None for value in stats.values()):
                out[f"m2po_versions_{first}_{end}"] = stats
    return out


def run_cell(k: int, correction: str, seed: int, args: argparse.Namespace, out: Path) -> dict:
    from decentrl.config import load_config
    from decentrl.launch.local import run_demo

    # At k = 0 every correction computes the same update (rho = pi_prox / mu is 1 to within the
    # engine/trainer agreement of 1e-5: no truncation, no mask, and a clip centred on mu or on
    # pi_prox is the same clip), so one run per seed serves them all.
    run_dir = out / (f"k0-seed{seed}" if k == 0 else f"k{k}-{correction}-seed{seed}")
    if not (run_dir / "summary.json").is_file():
        at_zero = correction if args.config is not None else "decoupled"
        config = load_config(
            base_config_path(args), cell_overrides(k, at_zero if k == 0 else correction, seed, args)
        )
        started = time.monotonic()
        with contextlib.redirect_stdout(sys.stderr):
            run_demo(config, str(run_dir))
        print(f"  cell done in {time.monotonic() - started:.0f} s", file=sys.stderr)
    summary = json.loads((run_dir / "summary.json").read_text())
    history = json.loads((run_dir / "history.json").read_text())
    evals = [step["metrics"]["eval_accuracy"] for step in history if "eval_accuracy" in step["metrics"]]
    final = statistics.fmean([*evals[-3:], summary["eval_after"]])
    versions, seconds = first_crossing(history, args.target)
    return {
        "max_staleness": k,
        "correction": correction,
        "seed": seed,
        "final_accuracy": round(final, 4),
        "eval_before": summary["eval_before"],
        "eval_after": summary["eval_after"],
        "versions_to_target": versions,
        "seconds_to_target": None if seconds is None else round(seconds, 1),
        "mean_staleness": summary["mean_staleness"],
        "staleness_histogram": summary["staleness_histogram"],
        "groups_expired": summary["num_groups_expired"],
        "rollouts_rejected": summary["num_rollouts_rejected"],
        "rl_wall_seconds": round(summary["rl_wall_seconds"], 1),
        "diagnostics": cell_diagnostics(history, correction),
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.merge:
        from benchmarks.staleness.merge import merge_studies

        result = merge_studies(
            [Path(path) for path in args.merge], Path(args.out or "runs/bench-staleness-merged")
        )
        print(json.dumps({k: v for k, v in result.items() if k != "cells"}))
        return 0
    plan = QUICK if args.quick else FULL
    staleness = args.staleness or plan["staleness"]
    corrections = args.corrections or ([CONFIG_CORRECTION] if args.config else plan["corrections"])
    seeds = args.seeds or plan["seeds"]
    if args.config is None:
        args.num_steps = args.num_steps or (150 if args.quick else 200)
    out = Path(args.out or ("runs/bench-staleness-quick" if args.quick else "runs/bench-staleness"))
    out.mkdir(parents=True, exist_ok=True)
    cells = []
    total = len(staleness) * len(corrections) * len(seeds)
    started = time.monotonic()
    for seed in seeds:
        for k in staleness:
            for correction in corrections:
                print(
                    f"[{len(cells) + 1}/{total}] max_staleness={k} correction={correction} seed={seed}",
                    file=sys.stderr,
                )
                cells.append(run_cell(k, correction, seed, args, out))
                c = cells[-1]
                print(
                    f"  final {c['final_accuracy']:.3f}, staleness mean {c['mean_staleness'] or 0:.2f}, "
                    f"target at v{c['versions_to_target']}",
                    file=sys.stderr,
                )
    table = aggregate(cells)
    if args.config is not None:  # what the cells ran with: the config's values where no flag named them
        from decentrl.config import load_config

        shape = load_config(args.config, config_cell_overrides(0, None, seeds[0], args))
        args.num_steps = shape.trainer.num_steps
        args.lr = shape.trainer.lr
        args.minibatches = shape.trainer.minibatches_per_version
        args.lora_rank = shape.lora.rank
    result = {
        "benchmark": "staleness",
        "config": args.config,
        "overrides": args.overrides,
        "num_steps": args.num_steps,
        "lr": args.lr,
        "minibatches_per_version": args.minibatches,
        "lora_rank": args.lora_rank,
        "target_accuracy": args.target,
        "seeds": seeds,
        "wall_seconds": round(time.monotonic() - started, 1),
        "headline": headline(table),
        "breaks_down_at": breakdowns(table),
        "table": table,
        "cells": cells,
    }
    (out / "study.json").write_text(json.dumps(result, indent=2))
    from decentrl.eval.staleness_plot import plot_staleness

    result["plot"] = str(plot_staleness(table, args.target, out / "staleness.png"))
    if len(seeds) > 1:
        from decentrl.eval.staleness_plot import plot_seeds

        result["seeds_plot"] = str(plot_seeds([result], out / "seeds.png"))
    print(json.dumps({k: v for k, v in result.items() if k != "cells"}))
    return 0
