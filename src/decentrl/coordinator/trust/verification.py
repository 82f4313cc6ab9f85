"""Sampled verification of accepted rollouts by a trusted verifier (docs/security.md).

At ingestion each rollout is picked for verification with probability `trust.verify_fraction`, by
the coordinator's randomness (a worker cannot tell which). A submission with a picked rollout is
*held*: none of its rollouts lets its group become ready for training until every verdict on it is
in. A verifier (`decentrl verifier`, trainer token) takes jobs, recomputes log-probs under the
claimed version and the plausibility statistics, and posts verdicts; the coordinator judges them
(`reputation.judge`), releases the holds of workers in good standing, and quarantines the others
(which discards their held rollouts). A verdict fails when its log-prob errors exceed the tolerance
of the engine class the worker declared (`tolerances.py`); the errors' mean test and the version
test (are the claims closer to the version before the claimed one?) each run a detector per worker. A job a verifier took but never answered
is handed out again.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
from collections import defaultdict

from decentrl.coordinator.context import Context
from decentrl.coordinator.db.store import add_event, complete_tasks, get_meta, set_meta
from decentrl.coordinator.trust import reputation, tolerances
from decentrl.dbapi import Connection
from decentrl.protocol import (
    RolloutImage,
    Segment,
    StageTrace,
    Verdict,
    VerdictBatch,
    VerifyJob,
    VerifyJobs,
    VerifyJobsRequest,
)
from decentrl.trust.logprob_tolerance import ToleranceTable

VERIFIED = "verified"
COMPUTE_KEY = "verify_compute_seconds"


def hold_sampled(
    db: Connection, context: Context, worker_id: str, stored: list[tuple[str, str]], now: float
) -> set[str]:
    """Pick rollouts of one submission ((rollout_id, task_id) pairs) to verify, and hold it if any;
    the picked rollout ids."""
    trust = context.run.trust
    fraction = trust.verify_fraction
    if fraction > 0 and reputation.tokens_verified(db, worker_id) < trust.probation_tokens:
        fraction = max(fraction, trust.probation_fraction)  # a newcomer is checked harder
    scale = 1 << 30
    picked = [rollout_id for rollout_id, _ in stored if secrets.randbelow(scale) < fraction * scale]
    if not picked:
        return set()
    submission_id = f"s-{secrets.token_hex(8)}"
    db.executemany(
        "INSERT INTO verify_jobs (rollout_id, submission_id, worker_id, state, pit_seed, created)"
        " VALUES (?, ?, ?, 'pending', ?, ?)",
        [(rollout_id, submission_id, worker_id, secrets.randbits(62), now) for rollout_id in picked],
    )
    db.executemany(
        "INSERT INTO holds (rollout_id, task_id, submission_id) VALUES (?, ?, ?)",
        [(rollout_id, task_id, submission_id) for rollout_id, task_id in stored],
    )
    return set(picked)


def _job(db: Connection, context: Context, row: sqlite3.Row, verifier_dtype: str) -> VerifyJob:
    rollout = db.execute("SELECT payload FROM rollouts WHERE rollout_id = ?", (row["rollout_id"],)).fetchone()
    payload = json.loads(rollout["payload"])
    _, tolerance = tolerances.worker_tolerance(db, context.tolerances, row["worker_id"], verifier_dtype)
    traced = db.execute(
        "SELECT traces FROM stage_traces WHERE rollout_id = ?", (row["rollout_id"],)
    ).fetchone()
    return VerifyJob(
        stage_traces=None
        if traced is None
        else [StageTrace.model_validate(t) for t in json.loads(traced[0])],
        stage_map=None if traced is None else context.stage_map,
        tolerance_mean=tolerance.mean,
        rollout_id=row["rollout_id"],
        temperature=payload["sampling"]["temperature"],
        prompt_token_ids=payload["prompt_token_ids"],
        segments=[Segment.model_validate(segment) for segment in payload["segments"]],
        pit_seed=row["pit_seed"],
        **_images(db, payload),
    )


def _images(db: Connection, payload: dict) -> dict:
    """A visual rollout's images and its task's seed (the verifier draws the images from it)."""
    if not payload.get("images"):
        return {}
    seed = db.execute("SELECT seed FROM tasks WHERE task_id = ?", (payload["task_id"],)).fetchone()[0]
    return {"images": [RolloutImage.model_validate(image) for image in payload["images"]], "seed": seed}


def next_jobs(context: Context, request: VerifyJobsRequest) -> VerifyJobs:
    """Up to `max_jobs` jobs: pending ones, or ones whose verifier went silent."""
    now = context.clock()
    retry_before = now - context.run.trust.verification_seconds
    with context.store.transaction() as db:
        rows = db.execute(
            "SELECT * FROM verify_jobs WHERE state = 'pending' OR (state = 'claimed' AND claimed < ?)"
            " ORDER BY created LIMIT ?",
            (retry_before, request.max_jobs),
        ).fetchall()
        db.executemany(
            "UPDATE verify_jobs SET state = 'claimed', claimed = ? WHERE rollout_id = ?",
            [(now, row["rollout_id"]) for row in rows],
        )
        return VerifyJobs(jobs=[_job(db, context, row, request.dtype) for row in rows])


def _release(db: Connection, submission_ids: set[str]) -> set[str]:
    """Drop the holds of submissions with no open job; returns the tasks they held."""
    tasks: set[str] = set()
    for submission_id in submission_ids:
        open_jobs = db.execute(
            "SELECT COUNT(*) FROM verify_jobs WHERE submission_id = ? AND state IN ('pending', 'claimed')",
            (submission_id,),
        ).fetchone()[0]
        if open_jobs == 0:
            rows = db.execute("SELECT task_id FROM holds WHERE submission_id = ?", (submission_id,))
            tasks |= {row["task_id"] for row in rows}
            db.execute("DELETE FROM holds WHERE submission_id = ?", (submission_id,))
    return tasks


def _blamed(db: Connection, rollout_id: str, stage: int, driver_id: str) -> str:
    """Who held `stage` for this rollout: its route's holder, or the driver for stage 0."""
    row = db.execute(
        "SELECT r.worker_id FROM lease_routes r JOIN rollouts o ON o.lease_id = r.lease_id"
        " WHERE o.rollout_id = ? AND r.stage = ?",
        (rollout_id, stage),
    ).fetchone()
    return driver_id if row is None else row[0]


def record_verdicts(context: Context, batch: VerdictBatch) -> dict:
    """Judge the verdicts, quarantine or release, and make released full groups ready."""
    trust, now = context.run.trust, context.clock()
    with context.store.transaction() as db:
        evidence: dict[str, list[reputation.Evidence]] = defaultdict(list)
        passed: dict[str, list[Verdict]] = defaultdict(list)
        error_evidence: dict[str, float] = defaultdict(float)
        version_evidence: dict[str, float] = defaultdict(float)
        submissions: set[str] = set()
        for verdict in batch.verdicts:
            job = db.execute(
                "SELECT * FROM verify_jobs WHERE rollout_id = ? AND state = 'claimed'", (verdict.rollout_id,)
            ).fetchone()
            if job is None:  # discarded meanwhile (quarantine), or answered twice
                continue
            state = "skipped" if verdict.unverifiable else "done"
            db.execute(
                "UPDATE verify_jobs SET state = ?, verdict = ? WHERE rollout_id = ?",
                (state, verdict.model_dump_json(), verdict.rollout_id),
            )
            submissions.add(job["submission_id"])
            if verdict.unverifiable:
                add_event(db, now, VERIFIED, job["worker_id"], f"unverifiable: {verdict.unverifiable}")
                continue
            if verdict.blame_stage is not None:  # a staged rollout: the stage that diverged answers for it
                holder = _blamed(db, verdict.rollout_id, verdict.blame_stage, job["worker_id"])
                detail = f"failed {verdict.rollout_id}: {verdict.blame_detail}"
                add_event(db, now, VERIFIED, holder, detail)
                evidence[holder].append(reputation.Evidence(verdict.num_tokens, True, verdict.pit_sums))
                continue
            key, tolerance = tolerances.worker_tolerance(
                db, context.tolerances, job["worker_id"], batch.dtype
            )
            failure = tolerance.failure(verdict.max_logprob_error)
            evidence[job["worker_id"]].append(
                reputation.Evidence(verdict.num_tokens, failure is not None, verdict.pit_sums)
            )
            error_evidence[job["worker_id"]] += verdict.error_log_evidence
            version_evidence[job["worker_id"]] += verdict.version_log_evidence
            if failure is None:
                passed[key].append(verdict)
            else:
                add_event(
                    db, now, VERIFIED, job["worker_id"], f"failed {verdict.rollout_id}: {failure} ({key})"
                )
        tolerances.record_passed(db, passed)
        for worker_id, items in evidence.items():
            reputation.judge(db, trust, worker_id, items, now)
            tolerances.judge_errors(db, trust, worker_id, error_evidence[worker_id], now)
            tolerances.judge_versions(db, trust, worker_id, version_evidence[worker_id], now)
        released = _release(db, submissions)
        completed = complete_tasks(db, released)
        total = float(get_meta(db, COMPUTE_KEY) or 0.0) + batch.compute_seconds
        set_meta(db, COMPUTE_KEY, repr(total))
    return {"judged": sum(len(items) for items in evidence.values()), "groups_completed": completed}


def summary(db: Connection, table: ToleranceTable) -> dict:
    states = dict(db.execute("SELECT state, COUNT(*) FROM verify_jobs GROUP BY state").fetchall())
    held = db.execute("SELECT COUNT(DISTINCT task_id) FROM holds").fetchone()[0]
    return {
        "jobs": {state: states.get(state, 0) for state in ("pending", "claimed", "done", "skipped")},
        "groups_held": held,
        "compute_seconds": float(get_meta(db, COMPUTE_KEY) or 0.0),
        **reputation.summary(db),
        **tolerances.summary(db, table),
    }
