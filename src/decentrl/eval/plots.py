"""Learning-curve figure of a run (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def plot_learning_curve(history: list[dict], eval_before: float, eval_after: float, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [
        (h["policy_version"], h["metrics"]["eval_accuracy"])
        for h in history
        if "eval_accuracy" in h["metrics"] and h["policy_version"] > 0  # v0 is `eval_before`
    ]
    history = [h for h in history if "reward_mean" in h["metrics"]]  # train steps (not v0's eval)
    versions = [h["policy_version"] for h in history]
    figure, (left, right, weights) = plt.subplots(1, 3, figsize=(15, 4))
    left.plot(versions, [h["metrics"]["reward_mean"] for h in history], alpha=0.35, label="batch reward")
    window = 10
    rewards = [h["metrics"]["reward_mean"] for h in history]
    smooth = [
        sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
        for i in range(len(rewards))
    ]
    left.plot(versions, smooth, label=f"batch reward ({window}-step mean)")
    points = [(0, eval_before), *evals]
    left.plot([v for v, _ in points], [a for _, a in points], "o-", label="held-out greedy accuracy")
    if versions:
        left.scatter(
            [versions[-1]],
            [eval_after],
            marker="*",
            s=150,
            zorder=3,
            label=f"final held-out {eval_after:.3f}",
        )
    left.set_xlabel("policy version (optimizer steps)")
    left.set_ylim(0, 1)
    left.legend(loc="lower right", fontsize=8)
    left.set_title("learning")
    right.plot(
        versions, [h["metrics"]["staleness_mean"] for h in history], label="mean staleness of trained tokens"
    )
    right.plot(versions, [h["metrics"]["staleness_max"] for h in history], alpha=0.5, label="max staleness")
    right.set_xlabel("policy version")
    right.legend(fontsize=8)
    right.set_title("off-policyness")
    deltas = [
        (v, 100 * h["metrics"]["weights_delta_ratio"])
        for v, h in zip(versions, history, strict=True)
        if "weights_delta_ratio" in h["metrics"]
    ]
    if deltas:
        percent = sorted(p for _, p in deltas)
        weights.plot(
            [v for v, _ in deltas],
            [p for _, p in deltas],
            color="tab:green",
            label="delta / full state (inference dtype)",
        )
        weights.axhline(3, color="gray", linestyle=":", label="3 %")
        weights.set_ylim(0, max(4.0, 1.1 * percent[-1]))
        weights.legend(fontsize=8)
        weights.set_title(f"weights sent per version (median {percent[len(percent) // 2]:.2f} %)")
    else:
        weights.set_title("weights sent per version (not reported)")
    weights.set_xlabel("policy version")
    weights.set_ylabel("% of a full state")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
