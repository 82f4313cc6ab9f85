"""The staleness study's figure: accuracy and time-to-target against max_staleness."""

from __future__ import annotations

from pathlib import Path


def plot_staleness(table: dict, target: float, path: Path) -> Path:
    """Left: final held-out accuracy (mean ± std over seeds) per correction; right: trainer
    seconds to first reach `target` (missing where some seed never did)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for correction, rows in sorted(table.items()):
        ks = sorted(int(k) for k in rows)
        means = [rows[str(k)]["final_accuracy_mean"] for k in ks]
        stds = [rows[str(k)]["final_accuracy_std"] for k in ks]
        left.errorbar(ks, means, yerr=stds, marker="o", capsize=3, label=correction)
        timed = [(k, rows[str(k)]["seconds_to_target_mean"]) for k in ks]
        timed = [(k, t) for k, t in timed if t is not None]
        if timed:
            right.plot(*zip(*timed, strict=True), marker="o", label=correction)
    ticks = sorted({int(k) for rows in table.values() for k in rows})
    for axis in (left, right):
        axis.set_xscale("symlog", linthresh=1)
        axis.set_xticks(ticks, [str(k) for k in ticks])
        axis.set_xlabel("max_staleness (versions)")
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend()
    if not right.lines:  # e.g. a real model's short study, far from the toy's target
        right.text(
            0.5, 0.5, f"no cell reached {target:.2f}", ha="center", va="center", transform=right.transAxes
        )
    left.set_ylabel("final held-out accuracy (greedy)")
    left.set_title("accuracy after the run")
    right.set_ylabel(f"trainer seconds to accuracy {target:.2f}")
    right.set_title("time to target")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _seed_bars(study: dict) -> list[tuple[str, int, list[tuple[float, float | None]]]]:
    """(label, k, (final accuracy, accuracy before RL) per seed) per bar: k = 0 once (every
    correction shares its run), then every correction at each k > 0, in the order run."""
    lora = study.get("lora_rank", 0) > 0
    bars = []
    for k in sorted({cell["max_staleness"] for cell in study["cells"]}):
        at_k = [cell for cell in study["cells"] if cell["max_staleness"] == k]
        for correction in dict.fromkeys(cell["correction"] for cell in at_k):
            same = {c["seed"]: c for c in at_k if c["correction"] == correction}
            name = "synchronous" if k == 0 else correction.replace("+", "\n+")
            label = f"k = {k}\n" + (f"LoRA\n{name}" if lora and k else "LoRA" if lora else name)
            seeds = [(same[seed]["final_accuracy"], same[seed].get("eval_before")) for seed in sorted(same)]
            bars.append((label, k, seeds))
            if k == 0:
                break
    return bars


def plot_seeds(studies: list[dict], path: Path, title: str | None = None) -> Path:
    """Final held-out accuracy per cell of one or more studies: bars at the mean over seeds,
    whiskers at ± one standard deviation, a dot per seed (one marker per warm start, told apart
    by the accuracy before RL the cells record); synchronous bars grey."""
    import statistics
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [bar for study in studies for bar in _seed_bars(study)]
    starts = list(dict.fromkeys(before for _, _, seeds in bars for _, before in seeds))
    markers = ["o", "s", "^", "D", "v"]
    figure, axis = plt.subplots(figsize=(max(6.0, 1.1 * len(bars) + 2), 5))
    finals = [final for _, _, seeds in bars for final, _ in seeds]
    floor = max(0.0, min(finals) - 0.2)
    for x, (_, k, seeds) in enumerate(bars):
        values = [final for final, _ in seeds]
        mean = statistics.fmean(values)
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        axis.bar(x, mean - floor, bottom=floor, width=0.7, color="#bbbbbb" if k == 0 else "#84b3d6")
        axis.errorbar(x, mean, yerr=std, color="black", capsize=5)
        for final, before in seeds:
            index = starts.index(before) % len(markers)
            axis.scatter(
                x,
                final,
                marker=markers[index],
                s=18,
                zorder=3,
                color="black" if index == 0 else "white",
                edgecolors="black",
            )
        axis.text(x, floor + 0.01, f"{mean:.3f}\n{len(values)} seeds", ha="center", va="bottom", fontsize=8)
    if len(starts) > 1:
        for index, before in enumerate(starts):
            label = "warm start" + ("" if before is None else f" {before:.3f} before RL")
            axis.scatter(
                [],
                [],
                marker=markers[index % len(markers)],
                color="black" if index == 0 else "white",
                edgecolors="black",
                label=label,
            )
        axis.legend(loc="upper right", fontsize=8)
    axis.set_xticks(range(len(bars)), [label for label, _, _ in bars], fontsize=8)
    axis.set_ylim(floor, min(1.0, max(finals) + 0.04))
    axis.set_ylabel("final held-out accuracy (greedy)")
    axis.grid(axis="y", alpha=0.3)
    title = title or "final held-out accuracy per cell (bars: mean, whiskers: ± std, markers: seeds)"
    axis.set_title("\n".join(textwrap.wrap(title, 120)), fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def main(argv: list[str] | None = None) -> int:
    """`python -m decentrl.eval.staleness_plot OUT.png STUDY.json... [--title T]`"""
    import argparse
    import json

    parser = argparse.ArgumentParser(description="draw staleness studies' final accuracy per cell and seed")
    parser.add_argument("out", type=Path, help="PNG to write")
    parser.add_argument("studies", type=Path, nargs="+", help="study.json files of decentrl bench staleness")
    parser.add_argument("--title", help="figure title")
    args = parser.parse_args(argv)
    studies = []
    for path in args.studies:
        try:
            studies.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            parser.error(f"cannot read {path}: {exc}")
    print(plot_seeds(studies, args.out, args.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
