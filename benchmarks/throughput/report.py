"""What `decentrl bench throughput` reads from each arm: its timeline of trained versions (the
synchronous loop's own file, or a demo's `train_metrics` table), the figures computed from it,
where each role's CPU went (py-spy stacks by category), and the accuracy-vs-wall-time plot.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from benchmarks.profiling import stacks

STEADY_SKIP = 0.25
"""The first quarter of the trained versions is warm-up, left out of the steady-state rate."""

# Innermost frame first: the first frame of a stack (walking outwards) that matches a category
# names the sample's category. Order matters only between patterns that can match one frame.
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("SQLite", ("sqlite3", "decentrl/coordinator/db/")),
    ("JSON", ("json/", "pydantic", "model_dump_json", "model_validate")),
    ("signing", ("cryptography/", "decentrl/weights/signing.py", "decentrl/trust/identity.py")),
    ("scoring", ("decentrl/rewards/", "decentrl/coordinator/pipeline/scoring.py")),
    ("replay", ("decentrl/coordinator/pipeline/replay.py", "decentrl/envs/episode.py:replay")),
    ("verification", ("decentrl/verifier/", "decentrl/coordinator/trust/verification.py")),
    (
        "weights",
        (
            "decentrl/weights/",
            "decentrl/worker/weights.py",
            "decentrl/model/lora.py:merge",
            "decentrl/trainer/checkpoint.py",
            "decentrl/coordinator/weights/",
        ),
    ),
    ("generation", ("decentrl/engines/", "decentrl/envs/")),
    ("training", ("decentrl/trainer/", "decentrl/algo/", "torch/autograd", "torch/optim")),
    ("evaluation", ("decentrl/eval/",)),
    (
        "HTTP",
        (
            "httpx",
            "httpcore",
            "h11/",
            "uvicorn",
            "starlette",
            "fastapi",
            "ssl.py",
            "socket.py",
            "selectors.py",
            "asyncio/",
            "anyio",
            "decentrl/client.py",
            "decentrl/coordinator/http/",
        ),
    ),
]
IDLE_FRAMES = ("threading.py:Condition.wait", "threading.py:Event.wait", "time.sleep", "selectors.py")


def category(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, patterns in CATEGORIES:
            if any(pattern in frame for pattern in patterns):
                return name
    return "other"


def categorise(collapsed: str) -> dict[str, float]:
    """Share of a py-spy (non-idle) profile's samples in each category, largest first."""
    counts: dict[str, int] = {}
    total = 0
    for frames, samples in stacks(collapsed):
        counts[category(frames)] = counts.get(category(frames), 0) + samples
        total += samples
    return {name: round(n / max(total, 1), 3) for name, n in sorted(counts.items(), key=lambda kv: -kv[1])}


def demo_timeline(db_path: Path) -> list[dict]:
    """The trained versions of a demo run (version 0 = the first publication), from its store."""
    import json

    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=30)
    try:
        first = db.execute("SELECT MIN(created) FROM weights").fetchone()[0]
        rows = db.execute("SELECT version, ts, metrics FROM train_metrics ORDER BY version").fetchall()
    finally:
        db.close()
    timeline = [] if first is None else [{"version": 0, "time": first, "num_rollouts": 0}]
    for version, ts, metrics in rows:
        values = json.loads(metrics)
        point = {"version": version, "time": ts, "num_rollouts": int(values.get("num_rollouts", 0))}
        if "eval_accuracy" in values:
            point["eval_accuracy"] = values["eval_accuracy"]
        timeline.append(point)
    return timeline


def figures(timeline: list[dict], process_start: float, threshold: float) -> dict:
    """Steady-state trained rollouts/s, time from process start to the first trained version and
    to `threshold` held-out accuracy, and the evaluations as (seconds since the first
    publication, accuracy) for the equal-RL-time comparison."""
    trained = [p for p in timeline if p["version"] > 0]
    out: dict = {"versions": len(trained), "rollouts_trained": sum(p["num_rollouts"] for p in trained)}
    if not timeline or not trained:
        return out | {
            "trained_rollouts_per_second": None,
            "first_version_s": None,
            f"time_to_{threshold}_s": None,
        }
    rl_start = timeline[0]["time"]
    skip = int(len(trained) * STEADY_SKIP)
    window = trained[skip:]
    span = window[-1]["time"] - (trained[skip - 1]["time"] if skip else rl_start)
    rollouts = sum(p["num_rollouts"] for p in window)
    out["trained_rollouts_per_second"] = round(rollouts / span, 1) if span > 0 else None
    out["versions_per_second"] = round(len(window) / span, 3) if span > 0 else None
    out["startup_s"] = round(rl_start - process_start, 2)
    out["first_version_s"] = round(trained[0]["time"] - process_start, 2)
    reached = [p for p in trained if p.get("eval_accuracy", 0.0) >= threshold]
    out[f"time_to_{threshold}_s"] = round(reached[0]["time"] - process_start, 2) if reached else None
    out["evals"] = [
        [
            round(p["time"] - process_start, 2),
            round(p["time"] - rl_start, 2),
            p["version"],
            p["eval_accuracy"],
        ]
        for p in trained
        if "eval_accuracy" in p
    ]
    out["rl_seconds"] = round(trained[-1]["time"] - rl_start, 2)
    return out


def accuracy_at(evals: list[list], rl_seconds: float) -> float | None:
    """The last held-out accuracy measured within `rl_seconds` of RL (None before the first)."""
    seen = [accuracy for _, rl, _, accuracy in evals if rl <= rl_seconds]
    return seen[-1] if seen else None


def plot(arms: dict[str, dict], threshold: float, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    for name, arm in arms.items():
        evals = arm.get("evals") or []
        axis.plot([e[0] for e in evals], [e[3] for e in evals], "o-", markersize=3, label=name)
    axis.axhline(threshold, color="grey", linestyle=":", linewidth=1)
    axis.set_xlabel("wall time from process start (s)")
    axis.set_ylabel("held-out greedy accuracy")
    axis.set_title("decentrl bench throughput: accuracy against wall time")
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
