"""What the dashboard shows, read from the run's store on a read-only connection.

Every function takes a read-only connection to the run's store (`weights/run_dir.read_only`:
`coordinator.db`, or the run's PostgreSQL database): the dashboard never writes and never blocks the
coordinator (SQLite's WAL; PostgreSQL's MVCC). Tables the run has not created yet (no verifier, no
trainer log-probs) read as empty.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from decentrl.dbapi import Connection
from decentrl.weights.run_dir import rows

THROUGHPUT_WINDOW_SECONDS = 30.0
MAX_EVENTS = 50
MAX_ROLLOUTS = 60

Decode = Callable[[int], str]
"""Token id -> its text (the coordinator's tokenizer)."""


def _rows(db: Connection, query: str, *args: object) -> list[Any]:
    return rows(db, query, *args)  # a table this run has not created (yet) reads as empty


def _by_worker(db: Connection, query: str, *args: object) -> dict[str, float]:
    return {row[0]: row[1] for row in _rows(db, query, *args)}


def latest_version(db: Connection) -> int | None:
    return db.execute("SELECT MAX(version) FROM weights").fetchone()[0]


def fleet(db: Connection, now: float, peers: dict[str, int]) -> list[dict]:
    """One row per registered worker; `peers` maps peer-serving workers to the version they hold."""
    latest = latest_version(db)
    since = now - THROUGHPUT_WINDOW_SECONDS
    accepted = _by_worker(db, "SELECT worker_id, COUNT(*) FROM rollouts GROUP BY worker_id")
    version = _by_worker(db, "SELECT worker_id, MAX(max_version) FROM rollouts GROUP BY worker_id")
    recent = _by_worker(
        db,
        "SELECT worker_id, SUM(num_model_tokens) FROM rollouts WHERE accepted >= ? GROUP BY worker_id",
        since,
    )
    rejected = _by_worker(
        db, "SELECT worker_id, COUNT(*) FROM events WHERE kind = 'rejected' GROUP BY worker_id"
    )
    held = _by_worker(
        db,
        "SELECT r.worker_id, COUNT(*) FROM holds h JOIN rollouts r USING (rollout_id) GROUP BY r.worker_id",
    )
    reputation = {row["worker_id"]: row for row in _rows(db, "SELECT * FROM reputation")}
    workers = []
    for row in db.execute("SELECT worker_id, name, engine, last_seen FROM workers ORDER BY registered"):
        worker_id = row["worker_id"]
        record = reputation.get(worker_id)
        sampled = version.get(worker_id)
        workers.append(
            {
                "worker_id": worker_id,
                "name": row["name"],
                "engine": row["engine"],
                "version": sampled,
                "lag": None if sampled is None or latest is None else latest - sampled,
                "tokens_per_second": (recent.get(worker_id) or 0) / THROUGHPUT_WINDOW_SECONDS,
                "accepted": int(accepted.get(worker_id, 0)),
                "rejected": int(rejected.get(worker_id, 0)),
                "held": int(held.get(worker_id, 0)),
                "strikes": 0 if record is None else record["violations"] + record["logprob_failures"],
                "quarantined": None if record is None or record["quarantined"] is None else record["reason"],
                "serving_peers": worker_id in peers,
                "peer_version": peers.get(worker_id),
                # never "-0 s ago": a replica's clock, or a call landing during this read
                "seconds_since_seen": max(0.0, now - row["last_seen"]),
            }
        )
    return workers


def curves(db: Connection) -> dict:
    """The trainer's step metrics as columns: {versions: [...], series: {name: [value | None]}}."""
    steps = [
        (row["version"], json.loads(row["metrics"]))
        for row in db.execute("SELECT version, metrics FROM train_metrics ORDER BY version")
    ]
    names = sorted({name for _, metrics in steps for name in metrics})
    return {
        "versions": [version for version, _ in steps],
        "series": {name: [metrics.get(name) for _, metrics in steps] for name in names},
    }


def staleness_histogram(db: Connection) -> dict[int, int]:
    rows = db.execute(
        "SELECT staleness, COUNT(*) FROM rollouts WHERE staleness IS NOT NULL GROUP BY staleness ORDER BY staleness"
    )
    return {int(value): int(count) for value, count in rows}


def weight_traffic(db: Connection) -> list[dict]:
    """Per version: its payload size, and the bytes that reached workers from the coordinator and
    from peers when they updated to it (as the workers report them, monitor/records.py)."""
    received = {
        row[0]: (row[1], row[2])
        for row in _rows(
            db,
            "SELECT version, SUM(coordinator_bytes), SUM(peer_bytes) FROM weight_traffic GROUP BY version",
        )
    }
    rows = db.execute("SELECT version, num_bytes FROM weights ORDER BY version")
    return [
        {
            "version": row["version"],
            "payload_bytes": row["num_bytes"],
            "coordinator_bytes": received.get(row["version"], (0, 0))[0],
            "peer_bytes": received.get(row["version"], (0, 0))[1],
        }
        for row in rows
    ]


UNTRUSTED_KINDS = "('lease_expired', 'group_filtered')"
"""Events of a healthy run, not of trust: left out of the trust panel."""


def trust_events(db: Connection) -> list[dict]:
    """The newest events that concern trust: rejections, quarantines, discards, bad peers, verdicts."""
    names = {row["worker_id"]: row["name"] for row in db.execute("SELECT worker_id, name FROM workers")}
    rows = db.execute(
        f"SELECT seq, ts, kind, worker_id, reason FROM events WHERE kind NOT IN {UNTRUSTED_KINDS} "
        "ORDER BY seq DESC LIMIT ?",
        (MAX_EVENTS,),
    )
    return [{**dict(row), "worker": names.get(row["worker_id"], row["worker_id"])} for row in rows]


def trust_event_kinds(db: Connection) -> list[dict]:
    """Every trust event of the run grouped by kind, the most frequent first: how many, from how
    many workers, the newest one's time and reason (the list above shows only the newest events)."""
    rows = db.execute(
        "SELECT kind, COUNT(*) AS count, COUNT(DISTINCT worker_id) AS workers, MAX(seq) AS last_seq "
        f"FROM events WHERE kind NOT IN {UNTRUSTED_KINDS} GROUP BY kind ORDER BY count DESC, kind"
    ).fetchall()
    kinds = []
    for row in rows:
        last = db.execute("SELECT ts, reason FROM events WHERE seq = ?", (row["last_seq"],)).fetchone()
        kinds.append(
            {
                "kind": row["kind"],
                "count": row["count"],
                "workers": row["workers"],
                "last_ts": last["ts"],
                "last_reason": last["reason"],
            }
        )
    return kinds
