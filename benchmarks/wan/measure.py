"""What `decentrl bench wan` reads from one run: its store (versions, evaluations, staleness,
refusals), the trainer's step times, the workers' logs (when each loaded which version) and the
fleet's record of who was online when."""

from __future__ import annotations

import json
import math
import re
import sqlite3
import statistics
import time
from pathlib import Path

from benchmarks.throughput.report import demo_timeline, figures

LOADED = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) decentrl\.worker\.weights INFO loaded weights v(\d+) "
)


def log_time(stamp: str, millis: str) -> float:
    """A log line's local `asctime` as unix time."""
    return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000


def loads(log: Path) -> list[tuple[float, int]]:
    """(time, version) of every version a worker's log says it loaded, over all its lives."""
    if not log.is_file():
        return []
    found = []
    for line in log.read_text(errors="replace").splitlines():
        match = LOADED.match(line)
        if match:
            found.append((log_time(match[1], match[2]), int(match[3])))
    return found


def online_at(lives: list[list], moment: float) -> bool:
    return any(start <= moment and (end is None or end > moment) for start, end in lives)


def reach_seconds(
    published: dict[int, float],
    loaded: dict[str, list[tuple[float, int]]],
    lives: dict[str, list[list]],
    share: float = 0.9,
) -> list[float | None]:
    """For each version: seconds from its publication until `share` of the workers online at that
    moment had loaded it or a later one (None: fewer ever did, killed or too slow)."""
    out: list[float | None] = []
    for version, at in sorted(published.items()):
        online = [name for name in lives if online_at(lives[name], at)]
        if not online:
            continue
        need = math.ceil(share * len(online))
        firsts = sorted(
            min((moment for moment, held in loaded.get(name, []) if held >= version), default=math.inf)
            for name in online
        )
        out.append(firsts[need - 1] - at if math.isfinite(firsts[need - 1]) else None)
    return out


def summarise_reach(reach: list[float | None]) -> dict:
    reached = sorted(value for value in reach if value is not None)
    return {
        "versions": len(reach),
        "reached_share": round(len(reached) / len(reach), 3) if reach else None,
        "median_s": round(statistics.median(reached), 3) if reached else None,
        "p90_s": round(reached[math.ceil(0.9 * len(reached)) - 1], 3) if reached else None,
    }


def store_facts(db_path: Path, threshold: float, stop: float) -> dict:
    """Versions, time to `threshold`, rates, staleness, refusals and the trainer's busy share,
    counting only what happened before `stop` (unix time)."""
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=30)
    try:
        created = dict(db.execute("SELECT version, created FROM weights").fetchall())
        steps = db.execute("SELECT version, ts, metrics FROM train_metrics ORDER BY version").fetchall()
        staleness = db.execute(
            "SELECT staleness, COUNT(*) FROM rollouts WHERE staleness IS NOT NULL GROUP BY 1 ORDER BY 1"
        ).fetchall()
        refused = db.execute(
            "SELECT reason, COUNT(*) FROM events WHERE kind = 'rejected' GROUP BY 1 ORDER BY 2 DESC"
        ).fetchall()
        events = dict(db.execute("SELECT kind, COUNT(*) FROM events GROUP BY 1").fetchall())
        accepted = db.execute("SELECT COUNT(*) FROM rollouts").fetchone()[0]
    finally:
        db.close()
    t0 = min(created.values()) if created else stop
    timeline = [point for point in demo_timeline(db_path) if point["time"] <= stop]
    out = figures(timeline, t0, threshold)  # "process start" = version 0's publication
    out.pop("startup_s", None)
    base = [json.loads(metrics).get("eval_accuracy") for version, _, metrics in steps if version == 0]
    out["eval_v0"] = base[0] if base else None  # the warm start's, before any update
    trained = [
        (version, ts, json.loads(metrics)) for version, ts, metrics in steps if version > 0 and ts <= stop
    ]
    # Between the first and the last trained version: the share of the time the trainer was not
    # in a training step (waiting for its batch, or its publication's hand-over). None: too few.
    out["trainer_idle_share"] = None
    if len(trained) >= 2 and trained[-1][1] > trained[0][1]:
        busy = sum(metrics.get("step_seconds", 0.0) for _, _, metrics in trained[1:])
        out["trainer_idle_share"] = round(max(0.0, 1.0 - busy / (trained[-1][1] - trained[0][1])), 3)
    histogram = {int(age): count for age, count in staleness}
    total = sum(histogram.values())
    out["staleness_histogram"] = histogram
    out["staleness_mean"] = round(sum(a * n for a, n in histogram.items()) / total, 3) if total else None
    out["rollouts_accepted"] = accepted
    out["refused"] = dict(refused)
    out["groups_expired"] = events.get("group_expired", 0)
    out["leases_expired"] = events.get("lease_expired", 0)
    out["t0"] = t0
    out["published"] = {int(version): at for version, at in created.items() if at <= stop}
    return out
