"""The staleness study's table from its cells: mean and spread over seeds, the headline (best
correction at the largest staleness run) and where each correction breaks down. Shared by a run
of `decentrl bench staleness` and by `--merge`."""

from __future__ import annotations

import statistics


def aggregate(cells: list[dict]) -> dict:
    """{correction: {k: mean/std over seeds}} of the final accuracy, and mean time to target."""
    table: dict[str, dict[str, dict]] = {}
    # corrections in the order they were run, staleness ascending
    order = list(dict.fromkeys(c["correction"] for c in cells))
    keys = sorted(
        {(c["correction"], c["max_staleness"]) for c in cells}, key=lambda key: (order.index(key[0]), key[1])
    )
    for correction, k in keys:
        same = [c for c in cells if c["correction"] == correction and c["max_staleness"] == k]
        finals = [c["final_accuracy"] for c in same]
        times = [c["seconds_to_target"] for c in same]
        table.setdefault(correction, {})[str(k)] = {
            "final_accuracy_mean": round(statistics.fmean(finals), 4),
            "final_accuracy_std": round(statistics.stdev(finals), 4) if len(finals) > 1 else 0.0,
            "num_seeds": len(finals),
            # None when some seed never reached the target within the run
            "seconds_to_target_mean": None if None in times else round(statistics.fmean(times), 1),
            "mean_staleness": round(statistics.fmean(c["mean_staleness"] or 0.0 for c in same), 2),
        }
    return table


def headline(table: dict) -> dict:
    """Best correction at the largest staleness run vs. staleness 0 of the same correction."""
    best = None
    for correction, rows in table.items():
        ks = sorted(int(k) for k in rows)
        if len(ks) < 2 or ks[0] != 0:
            continue
        high = str(8 if "8" in rows else ks[-1])
        drop = rows["0"]["final_accuracy_mean"] - rows[high]["final_accuracy_mean"]
        if best is None or drop < best["drop"]:
            best = {"correction": correction, "max_staleness": int(high), "drop": round(drop, 4)}
    return best or {}


BREAKDOWN_POINTS = 0.05


def breakdowns(table: dict) -> dict[str, int | None]:
    """Per correction, the smallest max_staleness whose mean final accuracy is more than
    BREAKDOWN_POINTS below staleness 0 (None: it held over the whole range run)."""
    out = {}
    for correction, rows in table.items():
        if "0" not in rows:
            continue
        base = rows["0"]["final_accuracy_mean"]
        broken = [int(k) for k, row in rows.items() if base - row["final_accuracy_mean"] > BREAKDOWN_POINTS]
        out[correction] = min(broken) if broken else None
    return out
