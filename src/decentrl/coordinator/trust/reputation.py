"""Per-worker reputation and quarantine, kept in the coordinator's store.

Evidence against a worker comes from four places: hostile protocol violations (`strike`), failed
log-prob recomputations and the sampling-plausibility test (`judge`, fed by the verifier's
verdicts), and slots of a group that repeat each other (`judge_repeats`, at ingestion). Crossing a limit quarantines the worker: its requests get 403, its open leases expire,
and its rollouts that are not yet in training are discarded (their slots are leased again), so
nothing it sent after the check failed reaches the loss. Every decision is an event with a reason.
"""

from __future__ import annotations

import json
import math
import sqlite3
from dataclasses import dataclass

from decentrl.config import TrustConfig
from decentrl.coordinator.context import Context
from decentrl.coordinator.db.store import REJECTED, add_event, discard_rollout
from decentrl.coordinator.http.errors import Reason
from decentrl.dbapi import Connection
from decentrl.protocol import Rollout
from decentrl.trust import repeats
from decentrl.trust.logprob_tolerance import LogprobTolerance
from decentrl.trust.plausibility import MAX_ORDER, look_alpha, looks_per_block, milestone, smooth_test

QUARANTINED = "quarantined"
DISCARDED = "discarded"
VIOLATION = "violation"

# Rejection reasons an honest worker running our code never earns (a retry after a lost answer can
# earn 'duplicate', a slow one 'lease_expired' or 'stale'; those are not held against anyone). They
# are charged only for the body of a request whose signature verified, so only the key holder can
# earn them: a bad signature, a replay or a clock outside the window is never one.
HOSTILE_REASONS = frozenset(
    {
        Reason.PROMPT,
        Reason.SAMPLING,
        Reason.OUT_OF_VOCAB,
        Reason.FOREIGN_LEASE,
        Reason.NOT_LEASED,
        Reason.UNKNOWN_LEASE,
        Reason.BAD_SEGMENT,
        Reason.STAGE_TRACE,
        Reason.BAD_LOGPROBS,
        Reason.BAD_FINISH,
        Reason.BAD_VERSION,
        Reason.TOO_LONG,
        Reason.ENV_MISMATCH,
        Reason.ENV_SIGNATURE,
        Reason.UNSCORABLE,
        Reason.IMAGE,
        Reason.IMAGE_MISMATCH,
        Reason.IMAGE_TOKENS,
        Reason.IMAGE_UNSIGNED,
    }
)


@dataclass
class Evidence:
    """One verified rollout, as the coordinator judges it."""

    num_tokens: int
    logprob_failed: bool
    pit_sums: list[float]


def _row(db: Connection, worker_id: str) -> sqlite3.Row:
    db.execute("INSERT OR IGNORE INTO reputation (worker_id) VALUES (?)", (worker_id,))
    return db.execute("SELECT * FROM reputation WHERE worker_id = ?", (worker_id,)).fetchone()


def quarantined(db: Connection, worker_id: str) -> str | None:
    """The reason `worker_id` is quarantined, or None."""
    row = db.execute(
        "SELECT quarantined, reason FROM reputation WHERE worker_id = ?", (worker_id,)
    ).fetchone()
    return None if row is None or row["quarantined"] is None else row["reason"]


def strike(db: Connection, trust: TrustConfig, worker_id: str, reason: str, now: float) -> None:
    """Count a hostile protocol violation; quarantine at `trust.max_violations`."""
    if reason not in HOSTILE_REASONS or quarantined(db, worker_id) is not None:
        return
    violations = _row(db, worker_id)["violations"] + 1
    score = max(0.0, 1.0 - violations / trust.max_violations)
    db.execute(
        "UPDATE reputation SET violations = ?, score = MIN(score, ?) WHERE worker_id = ?",
        (violations, score, worker_id),
    )
    add_event(db, now, VIOLATION, worker_id, reason)
    if violations >= trust.max_violations:
        quarantine(db, worker_id, f"{violations} protocol violations (last: {reason})", now)


def record_rejection(context: Context, worker_id: str | None, reason: str) -> None:
    """One `rejected` event; a hostile reason also counts against the worker (`strike`)."""
    with context.store.transaction() as db:
        add_event(db, context.clock(), REJECTED, worker_id, reason)
        if worker_id is not None:
            strike(db, context.run.trust, worker_id, reason, context.clock())


def judge(db: Connection, trust: TrustConfig, worker_id: str, evidence: list[Evidence], now: float) -> None:
    """Fold one batch of a worker's verified rollouts into its record; test plausibility at milestones."""
    if quarantined(db, worker_id) is not None or not evidence:
        return
    row = _row(db, worker_id)
    failures = row["logprob_failures"] + sum(item.logprob_failed for item in evidence)
    tokens, sums = row["block_tokens"], json.loads(row["block_sums"]) or [0.0] * MAX_ORDER
    added = sum(item.num_tokens for item in evidence)
    for item in evidence:
        sums = [total + value for total, value in zip(sums, item.pit_sums, strict=False)]
    block, minimum = row["block"], trust.plausibility_min_tokens
    looks = looks_per_block(minimum, trust.plausibility_block_tokens)
    threshold = look_alpha(trust.plausibility_alpha, block, looks)
    decision = smooth_test(sums, tokens + added, threshold)
    tested = milestone(tokens + added, minimum) > milestone(tokens, minimum)
    tokens += added
    if tokens >= trust.plausibility_block_tokens and not (tested and decision.reject):
        tokens, sums, block = 0, [0.0] * MAX_ORDER, block + 1  # fresh block: recent behaviour decides
    evidence_ratio = min(1.0, max(0.0, _log(decision.p_value) / _log(threshold)))
    score = max(0.0, 1.0 - max(failures / trust.max_logprob_failures, evidence_ratio))
    db.execute(
        "UPDATE reputation SET verified = verified + ?, logprob_failures = ?, tokens_verified ="
        " tokens_verified + ?, block = ?, block_tokens = ?, block_sums = ?, p_value = ?, score = ?"
        " WHERE worker_id = ?",
        (len(evidence), failures, added, block, tokens, json.dumps(sums), decision.p_value, score, worker_id),
    )
    if failures >= trust.max_logprob_failures:
        quarantine(db, worker_id, f"{failures} rollouts failed log-prob recomputation", now)
    elif tested and decision.reject:
        detail = f"p={decision.p_value:.2e} < {threshold:.2e} over {tokens} tokens"
        quarantine(db, worker_id, f"tokens implausible as samples of the policy ({detail})", now)


def judge_repeats(
    db: Connection,
    trust: TrustConfig,
    worker_id: str,
    rollouts: list[Rollout],
    now: float,
    tolerance: LogprobTolerance,
) -> bool:
    """Fold one submission into the worker's repeated-completion detector; True if it is now quarantined.
    `tolerance`: the worker's log-prob tolerance, by which its claimed probabilities may be low."""
    if trust.repeat_alpha == 0 or quarantined(db, worker_id) is not None:
        return False
    row = db.execute("SELECT * FROM repeat_evidence WHERE worker_id = ?", (worker_id,)).fetchone()
    submission = 1 + (row["submissions"] if row else 0)
    references = _references(db, worker_id, {rollout.task_id for rollout in rollouts})
    known = set(references)
    log_e = repeats.log_evidence(rollouts, tolerance, trust.repeat_bet, references)
    db.executemany(
        "INSERT INTO repeat_references (worker_id, task_id, digest) VALUES (?, ?, ?)",
        [(worker_id, task_id, digest) for task_id, digest in references.items() if task_id not in known],
    )
    detector = repeats.detector_step(row["detector"] if row else None, trust.repeat_alpha, submission, log_e)
    db.execute(
        "INSERT OR REPLACE INTO repeat_evidence (worker_id, submissions, detector) VALUES (?, ?, ?)",
        (worker_id, submission, detector),
    )
    if detector < 0:
        return False
    detail = f"log-evidence {detector:.1f} nats over its threshold at submission {submission}"
    quarantine(
        db, worker_id, f"slots of groups repeat each other, unlike independent samples ({detail})", now
    )
    return True


def _references(db: Connection, worker_id: str, task_ids: set[str]) -> dict[str, str]:
    """The worker's reference completions for `task_ids` from its earlier submissions (one indexed
    lookup per task of the submission: no scan of its history)."""
    references = {}
    for task_id in task_ids:
        row = db.execute(
            "SELECT digest FROM repeat_references WHERE worker_id = ? AND task_id = ?", (worker_id, task_id)
        ).fetchone()
        if row is not None:
            references[task_id] = row["digest"]
    return references


def tokens_verified(db: Connection, worker_id: str) -> int:
    row = db.execute("SELECT tokens_verified FROM reputation WHERE worker_id = ?", (worker_id,)).fetchone()
    return 0 if row is None else row["tokens_verified"]


def _log(value: float) -> float:
    return math.log(max(value, 1e-300))


def quarantine(db: Connection, worker_id: str, reason: str, now: float) -> int:
    """Quarantine `worker_id`, expire its leases, discard its untrained rollouts; returns how many."""
    _row(db, worker_id)
    db.execute(
        "UPDATE reputation SET quarantined = ?, reason = ?, score = 0 WHERE worker_id = ?",
        (now, reason, worker_id),
    )
    add_event(db, now, QUARANTINED, worker_id, reason)
    # Its own leases, and a stage holder's routed ones: what passed through it is not trusted either.
    routed = "SELECT lease_id FROM lease_routes WHERE worker_id = ?"
    leases = db.execute(
        f"SELECT lease_id FROM leases WHERE (worker_id = ? OR lease_id IN ({routed})) AND state = 'open'",
        (worker_id, worker_id),
    ).fetchall()
    for lease in leases:
        db.execute("UPDATE leases SET state = 'expired' WHERE lease_id = ?", (lease["lease_id"],))
        db.execute(
            "UPDATE slots SET lease_id = NULL WHERE lease_id = ? AND rollout_id IS NULL", (lease["lease_id"],)
        )
    rows = db.execute(
        "SELECT r.rollout_id FROM rollouts r JOIN tasks t ON t.task_id = r.task_id"
        f" WHERE (r.worker_id = ? OR r.lease_id IN ({routed})) AND t.state IN ('pending', 'ready')",
        (worker_id, worker_id),
    ).fetchall()
    for row in rows:
        discard_rollout(db, row["rollout_id"])
    in_training = db.execute(
        "SELECT COUNT(*) FROM rollouts r JOIN tasks t ON t.task_id = r.task_id"
        f" WHERE (r.worker_id = ? OR r.lease_id IN ({routed})) AND t.state = 'batched'",
        (worker_id, worker_id),
    ).fetchone()[0]
    add_event(
        db, now, DISCARDED, worker_id, f"{len(rows)} untrained rollouts ({in_training} already batched)"
    )
    return len(rows)


def summary(db: Connection) -> dict:
    """Workers with a record: counts, score, quarantine state (for `/v1/stats`)."""
    rows = db.execute("SELECT * FROM reputation ORDER BY worker_id").fetchall()
    workers = {
        row["worker_id"]: {
            "score": row["score"],
            "violations": row["violations"],
            "verified": row["verified"],
            "logprob_failures": row["logprob_failures"],
            "plausibility_p": row["p_value"],
            "quarantined": row["reason"] if row["quarantined"] is not None else None,
        }
        for row in rows
    }
    return {"workers_quarantined": sum(1 for w in workers.values() if w["quarantined"]), "workers": workers}
