"""The figure of `decentrl bench wan`: held-out accuracy against wall time per run, and time to the
threshold by RTT for each mode."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend

COLOURS = {"decentrl": "tab:green", "barrier": "tab:red", "nolatency": "tab:blue"}


def plot(results: list[dict], threshold: float, path: Path) -> Path:
    figure, (curves, bars) = plt.subplots(1, 2, figsize=(13, 4.5))
    # the curves of the RTT with the most runs (every seed), beside the runs without added latency
    rtts = [r["rtt_ms"] for r in results if r["mode"] != "nolatency"]
    focus = max(set(rtts), key=rtts.count) if rtts else 0.0
    labelled = set()
    for run in sorted(results, key=lambda r: (r["mode"], r["seed"])):
        if run["mode"] != "nolatency" and run["rtt_ms"] != focus:
            continue
        label = (
            None
            if run["mode"] in labelled
            else f"{run['mode']}" + ("" if run["mode"] == "nolatency" else f" {focus:g} ms")
        )
        labelled.add(run["mode"])
        evals = run.get("evals") or []
        points = ([(0.0, run["eval_v0"])] if run.get("eval_v0") is not None else []) + [
            (e[0], e[3]) for e in evals
        ]
        curves.plot(
            [t for t, _ in points],
            [a for _, a in points],
            "-",
            marker="o",
            markersize=3,
            color=COLOURS[run["mode"]],
            label=label,
            alpha=0.7,
        )
    curves.axhline(threshold, color="grey", linestyle=":", linewidth=1)
    curves.set_xlabel("wall time from version 0 (s); one line per seed")
    curves.set_ylabel("held-out greedy accuracy")
    curves.legend(fontsize=7)
    curves.grid(alpha=0.3)
    rtts = sorted({r["rtt_ms"] for r in results if r["mode"] != "nolatency"})
    width = 0.35
    for offset, mode in ((-0.55, "decentrl"), (0.55, "barrier")):
        means = []
        for rtt in rtts:
            times = [r["time_to_threshold_s"] for r in results if r["mode"] == mode and r["rtt_ms"] == rtt]
            means.append(sum(times) / len(times) if times and None not in times else 0.0)
        bars.bar(
            [i + offset * width for i in range(len(rtts))], means, width, color=COLOURS[mode], label=mode
        )
    flat = [
        r["time_to_threshold_s"] for r in results if r["mode"] == "nolatency" and r["time_to_threshold_s"]
    ]
    if flat:
        bars.axhline(sum(flat) / len(flat), color=COLOURS["nolatency"], linestyle="--", label="nolatency")
    bars.set_xticks(range(len(rtts)), [f"{rtt:g} ms" for rtt in rtts])
    bars.set_xlabel("round-trip time")
    bars.set_ylabel(f"s from version 0 to {threshold} (mean of seeds)")
    bars.legend(fontsize=8)
    bars.grid(axis="y", alpha=0.3)
    figure.suptitle("decentrl bench wan: an emulated internet fleet on one machine", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
