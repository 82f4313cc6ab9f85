"""The figure of `decentrl bench swarm`: reach time, trainer idle time and coordinator replicas."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend


def plot(results: dict, path: Path) -> None:
    runs = results["runs"]
    labels = sorted({(r["params_billion"], r["training"]) for r in runs})
    names = [f"{p:g}B {t}" for p, t in labels]
    figure, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    width = 0.27
    variants = (
        (False, False, "coordinator only", "tab:red"),
        (True, False, "peer relay", "tab:blue"),
        (True, True, "peer relay, background fetch", "tab:green"),
    )
    for position, (relay, background, label, colour) in enumerate(variants):
        chosen = [
            next(
                r
                for r in runs
                if (r["params_billion"], r["training"]) == key
                and r["relay"] == relay
                and r.get("background_fetch", False) == background
            )
            for key in labels
        ]
        xs = [i + (position - 1) * width for i in range(len(labels))]
        # A run in which no version reached 90 % of the fleet is drawn at the top, hatched.
        reach = [r["reach_90_seconds_median"] for r in chosen]
        top = max([v for r in runs for v in [r["reach_90_seconds_median"]] if v is not None] + [1.0])
        heights = [v if v is not None else top * 1.5 for v in reach]
        bars = axes[0].bar(xs, heights, width, color=colour, label=label)
        for bar, value in zip(bars, reach, strict=True):
            if value is None:
                bar.set_hatch("//")
                bar.set_alpha(0.4)
        axes[1].bar(xs, [r["trainer_idle_fraction"] for r in chosen], width, color=colour, label=label)
        axes[2].bar(xs, [r["coordinator"]["replicas"] for r in chosen], width, color=colour, label=label)
    titles = (
        "median s until 90 % of the online fleet\nholds a new version (hatched: never)",
        "trainer idle fraction",
        "coordinator replicas (1 core each, 70 %)",
    )
    for axis, title in zip(axes, titles, strict=True):
        axis.set_title(title, fontsize=10)
        axis.set_xticks(range(len(labels)), names, rotation=30, fontsize=8)
        axis.grid(axis="y", alpha=0.3)
    axes[0].set_yscale("log")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=8)
    workers = results.get("workers", 10_000)
    figure.suptitle(f"decentrl bench swarm: {workers:,} simulated workers", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
