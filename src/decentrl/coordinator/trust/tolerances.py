"""The run's log-prob tolerances (trust/logprob_tolerance.py) in the coordinator: looked up, tested, observed.

The table in force is stored with the run (`Context.tolerances`). Each worker is held to the entry
of the engine class it declared at registration: a token beyond the entry's `max` fails its
rollout, and the verifier's mean-test evidence feeds a per-worker detector here, as does its
version-test evidence (verifier/version_check.py) another. What the verifier
measured on rollouts that passed is kept per class (count, largest token error, largest and mean
rollout mean), so `/v1/stats` shows the margin an honest fleet leaves under its tolerance: evidence for
recalibrating, never an input to the decisions (hostile rollouts that pass would drag it).
"""

from __future__ import annotations

import json

from decentrl.config import TrustConfig
from decentrl.coordinator.db.store import get_meta, set_meta
from decentrl.coordinator.trust import reputation
from decentrl.dbapi import Connection
from decentrl.protocol import Verdict
from decentrl.trust.logprob_tolerance import ANY_ENGINE, LogprobTolerance, ToleranceTable
from decentrl.trust.repeats import detector_step

OBSERVED_META = "logprob_errors_passed"


def worker_tolerance(
    db: Connection, table: ToleranceTable, worker_id: str, verifier_dtype: str | None = None
) -> tuple[str, LogprobTolerance]:
    """The table key and entry `worker_id`'s declared engine class is held to; with
    `verifier_dtype`, the looser of that and the verifier's own dtype's entry."""
    row = db.execute("SELECT engine, dtype, device FROM workers WHERE worker_id = ?", (worker_id,)).fetchone()
    if row is None:  # not reachable through the API (every job's worker registered); be strict
        key, entry = min(table.entries.items(), key=lambda item: (item[1].max, item[1].mean))
    else:
        key, entry = table.lookup(row["engine"], row["dtype"], row["device"])
    if verifier_dtype is not None:
        verifier_key, verifier_entry = table.lookup(ANY_ENGINE, verifier_dtype, "any")
        combined = entry.looser(verifier_entry)
        if combined != entry:
            key, entry = f"{key} + verifier {verifier_key}", combined
    return key, entry


def judge_errors(db: Connection, trust: TrustConfig, worker_id: str, log_e: float, now: float) -> None:
    """Fold one verdict batch's mean-test evidence into the worker's detector; quarantine when it
    crosses (a CUSUM over e-values with `trust.logprob_alpha` spent over batches, `repeats.py`)."""
    reason = "log-prob errors above its engine class's mean tolerance"
    _detect(db, worker_id, "error", trust.logprob_alpha, log_e, reason, now)


def judge_versions(db: Connection, trust: TrustConfig, worker_id: str, log_e: float, now: float) -> None:
    """The same for the version test's evidence (verifier/version_check.py), with `trust.version_alpha`."""
    reason = "log-probs that the version before the claimed one explains better (a wrong version claim)"
    _detect(db, worker_id, "version", trust.version_alpha, log_e, reason, now)


def _detect(
    db: Connection, worker_id: str, test: str, alpha: float, log_e: float, reason: str, now: float
) -> None:
    """One step of the `test`_detector of `worker_id` (columns `test`_batches, `test`_detector)."""
    assert test in ("error", "version")  # column names, never user input
    if reputation.quarantined(db, worker_id) is not None:
        return
    row = db.execute(
        f"SELECT {test}_batches AS batches, {test}_detector AS detector FROM reputation WHERE worker_id = ?",
        (worker_id,),
    ).fetchone()
    batch = row["batches"] + 1
    detector = detector_step(row["detector"], alpha, batch, log_e)
    db.execute(
        f"UPDATE reputation SET {test}_batches = ?, {test}_detector = ? WHERE worker_id = ?",
        (batch, detector, worker_id),
    )
    if detector >= 0:
        detail = f"log-evidence {detector:.1f} nats over its threshold at verdict batch {batch}"
        reputation.quarantine(db, worker_id, f"{reason} ({detail})", now)


def record_passed(db: Connection, passed: dict[str, list[Verdict]]) -> None:
    """Fold the verdicts that passed, by table key, into the observed statistics."""
    if not passed:
        return
    observed = json.loads(get_meta(db, OBSERVED_META) or "{}")
    for key, verdicts in passed.items():
        entry = observed.setdefault(
            key, {"rollouts": 0, "tokens": 0, "max_error": 0.0, "rollout_mean_max": 0.0, "error_sum": 0.0}
        )
        for verdict in verdicts:
            entry["rollouts"] += 1
            entry["tokens"] += verdict.logprob_tokens
            entry["max_error"] = max(entry["max_error"], verdict.max_logprob_error)
            entry["rollout_mean_max"] = max(entry["rollout_mean_max"], verdict.mean_logprob_error)
            entry["error_sum"] += verdict.mean_logprob_error * verdict.logprob_tokens
    set_meta(db, OBSERVED_META, json.dumps(observed))


def summary(db: Connection, table: ToleranceTable) -> dict:
    """For `/v1/stats` → trust: the table in force and, per class, what passing rollouts showed."""
    observed = json.loads(get_meta(db, OBSERVED_META) or "{}")
    for entry in observed.values():
        entry["mean_error"] = entry.pop("error_sum") / entry["tokens"] if entry["tokens"] else 0.0
    return {"logprob_tolerances": table.as_dict(), "logprob_errors_passed": observed}
