"""The figure of `decentrl bench pipeline`: generated tokens/s against batch size, one panel per
number of stages, one line per added round-trip time, the whole model in one engine for scale."""

from __future__ import annotations

from pathlib import Path


def plot(summary: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stage_counts = sorted({c["stages"] for c in summary["pipeline"]})
    figure, axes = plt.subplots(1, len(stage_counts), figsize=(6.5 * len(stage_counts), 4.5), squeeze=False)
    full = summary["full_model"]
    rtts = sorted({c["rtt_ms"] for c in summary["pipeline"]})
    colours = plt.get_cmap("viridis")([i / max(1, len(rtts) - 1) * 0.85 for i in range(len(rtts))])
    for axis, stages in zip(axes[0], stage_counts, strict=True):
        axis.plot(
            [c["batch"] for c in full],
            [c["tokens_per_s"] for c in full],
            "k-",
            marker="s",
            label="whole model (hf)",
        )
        for colour, rtt in zip(colours, rtts, strict=True):
            for server, style in (("as shipped", "-"), ("connection per step", ":")):
                cells = [
                    c
                    for c in summary["pipeline"]
                    if (c["stages"], c["rtt_ms"], c["server"]) == (stages, rtt, server)
                ]
                if not cells:
                    continue
                label = f"{stages} stages, +{rtt:g} ms RTT" + (
                    ", a connection per step" if server == "connection per step" else ""
                )
                axis.plot(
                    [c["batch"] for c in cells],
                    [c["tokens_per_s"] for c in cells],
                    style,
                    marker="o",
                    color=colour,
                    label=label,
                )
        axis.set_xscale("log", base=2)
        axis.set_xticks([c["batch"] for c in full], [str(c["batch"]) for c in full])
        axis.set_yscale("log")
        axis.set_xlabel("batch size (sequences decoded together)")
        axis.set_ylabel("generated tokens/s")
        axis.set_title(f"{stages} stages, {summary['codec']} boundary")
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=7)
    load = ", ".join(f"{x:g}" for x in summary["load_average"])
    figure.suptitle(
        f"decentrl bench pipeline: {summary['model']}, {summary['cpu_count']} CPU cores, load {load} at the end",
        fontsize=10,
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
