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
        axis.legend()
    left.set_ylabel("final held-out accuracy (greedy)")
    left.set_title("accuracy after the run")
    right.set_ylabel(f"trainer seconds to accuracy {target:.2f}")
    right.set_title("time to target")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
