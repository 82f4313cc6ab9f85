"""Ingestion of submitted rollouts: bind each to its lease, check it, store it, queue its reward.

The order is the defence (docs/security.md): `bind` checks everything that costs little (lease,
slot, duplicates, prompt, sampling, token ids, lengths, versions, sizes of free-form fields) in one
short transaction and refuses the whole submission on the first failure, before anything costly
runs; only a submission that binds has its episodes replayed (`replay.py`, environment code,
outside the store's lock, charged to the worker's budget by the route: `scoring_budget.py`);
`accept` then checks the binding again (the state may have moved meanwhile) and stores every
rollout or none. A refusal answers 4xx with a detail naming the rollout and the problem and
records one `rejected` event with a short reason. The reward is computed after the answer, in the
scoring pool (`scoring.py`), whose time is charged to the same budget, and a group becomes ready
for training once all its rewards are in.
A worker's claimed reward is ignored.

The trainer's own rollouts (colocated mode, worker id `LOCAL_WORKER`, sent with the trainer token)
take the same path, checks, replay and reward, minus what judges an untrusted sender: no
repeated-completion detector, no sampled verification, no strikes.
"""

from __future__ import annotations

import json
import math
import sqlite3
from dataclasses import dataclass

from decentrl.coordinator.context import Context
from decentrl.coordinator.db.store import REJECTED, add_event, complete_tasks, is_filled, latest_version
from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.coordinator.pipeline.image_binding import check_images
from decentrl.coordinator.pipeline.leasing import LOCAL_WORKER
from decentrl.coordinator.pipeline.replay import Replayed, replay_rollouts
from decentrl.coordinator.trust import reputation, tolerances, verification
from decentrl.coordinator.trust.reputation import record_rejection
from decentrl.coordinator.trust.stage_traces import check_traces
from decentrl.dbapi import Connection
from decentrl.protocol import Rollout, RolloutSubmission, SamplingParams, SubmissionResult
from decentrl.rewards.rubric import ScoreJob


@dataclass(frozen=True)
class Checked:
    rollout: Rollout
    replayed: Replayed
    min_version: int
    max_version: int
    num_model_tokens: int


def _lease(db: Connection, lease_id: str, worker_id: str, now: float) -> sqlite3.Row:
    lease = db.execute("SELECT * FROM leases WHERE lease_id = ?", (lease_id,)).fetchone()
    if lease is None:
        raise ApiError(404, f"unknown lease {lease_id!r}", Reason.UNKNOWN_LEASE)
    if lease["worker_id"] != worker_id:
        raise ApiError(403, f"lease {lease_id!r} belongs to another worker", Reason.FOREIGN_LEASE)
    if lease["state"] == "expired" or lease["deadline"] < now:
        raise ApiError(
            410, f"lease {lease_id!r} expired; its slots are leased to others", Reason.LEASE_EXPIRED
        )
    return lease


def _slot(db: Connection, rollout: Rollout) -> sqlite3.Row:
    row = db.execute(
        "SELECT s.rollout_id FROM lease_slots ls JOIN slots s ON s.task_id = ls.task_id AND s.slot = ls.slot"
        " WHERE ls.lease_id = ? AND ls.task_id = ? AND ls.slot = ?",
        (rollout.lease_id, rollout.task_id, rollout.slot),
    ).fetchone()
    if row is None:
        detail = f"task {rollout.task_id!r} slot {rollout.slot} is not part of lease {rollout.lease_id!r}"
        raise ApiError(422, detail, Reason.NOT_LEASED)
    return row


def _model_tokens(context: Context, rollout: Rollout) -> tuple[list[int], list[int]]:
    """All model token ids and their policy versions, after checking every segment."""
    vocab_size = context.model.vocab_size
    token_ids: list[int] = []
    versions: list[int] = []
    for index, segment in enumerate(rollout.segments):
        outside = next((t for t in segment.token_ids if not 0 <= t < vocab_size), None)
        if outside is not None:
            detail = f"segments[{index}]: token id {outside} is outside the vocabulary [0, {vocab_size})"
            raise ApiError(422, detail, Reason.OUT_OF_VOCAB)
        if segment.source == "env":
            if segment.logprobs is not None or segment.policy_versions is not None:
                detail = f"segments[{index}]: env segments must not carry logprobs or policy_versions"
                raise ApiError(422, detail, Reason.BAD_SEGMENT)
            continue
        length = len(segment.token_ids)
        if segment.logprobs is None or segment.policy_versions is None:
            detail = f"segments[{index}]: model segments need logprobs and policy_versions"
            raise ApiError(422, detail, Reason.BAD_SEGMENT)
        if len(segment.logprobs) != length or len(segment.policy_versions) != length:
            detail = (
                f"segments[{index}]: {length} token_ids but {len(segment.logprobs)} logprobs and "
                f"{len(segment.policy_versions)} policy_versions; they must have the same length"
            )
            raise ApiError(422, detail, Reason.BAD_SEGMENT)
        if not all(math.isfinite(value) and value <= 0.0 for value in segment.logprobs):
            raise ApiError(422, f"segments[{index}]: logprobs must be finite and <= 0", Reason.BAD_LOGPROBS)
        token_ids += segment.token_ids
        versions += segment.policy_versions
    return token_ids, versions


def _check_generation(context: Context, rollout: Rollout, token_ids: list[int]) -> None:
    limit = context.config.max_new_tokens
    if not token_ids:
        raise ApiError(422, "a rollout needs at least one model segment", Reason.BAD_SEGMENT)
    if len(token_ids) > limit:
        raise ApiError(422, f"{len(token_ids)} model tokens exceed max_new_tokens={limit}", Reason.TOO_LONG)
    if rollout.finish_reason == "stop" and token_ids[-1] not in context.model.eos_token_ids:
        detail = f"finish_reason 'stop' but the last model token is {token_ids[-1]}, not eos"
        raise ApiError(422, f"{detail} {list(context.model.eos_token_ids)}", Reason.BAD_FINISH)


def _check_versions(context: Context, versions: list[int], latest: int | None) -> None:
    max_staleness = context.config.max_staleness
    if min(versions) < 0:
        raise ApiError(422, f"policy version {min(versions)} is negative", Reason.BAD_VERSION)
    if latest is None or max(versions) > latest:
        raise ApiError(
            409, f"policy version {max(versions)} is newer than the latest ({latest})", Reason.STALE
        )
    if latest - min(versions) > max_staleness:
        detail = (
            f"stale: tokens sampled with policy version {min(versions)}, latest is {latest} and "
            f"max_staleness is {max_staleness}; versions must be >= {latest - max_staleness}"
        )
        raise ApiError(409, detail, Reason.STALE)


def _check_sizes(context: Context, rollout: Rollout) -> None:
    """Free-form fields are stored as sent: each has a byte budget."""
    limit = context.config.max_transcript_bytes
    size = len(json.dumps(rollout.transcript)) + len(json.dumps(rollout.timings))
    if size > limit:
        detail = f"transcript and timings take {size} bytes, over coordinator.max_transcript_bytes={limit}"
        raise ApiError(413, detail, Reason.OVERSIZED)


def _check(
    db: Connection,
    context: Context,
    worker_id: str,
    rollout: Rollout,
    now: float,
    replayed: Replayed | None,
) -> Checked | None:
    """Every check of one rollout; with `replayed` None (binding, before the replay) the replay's
    outcome is not looked at."""
    _check_sizes(context, rollout)
    lease = _lease(db, rollout.lease_id, worker_id, now)
    if _slot(db, rollout)["rollout_id"] is not None:
        raise ApiError(
            409, f"task {rollout.task_id!r} slot {rollout.slot} is already filled", Reason.DUPLICATE
        )
    task = db.execute("SELECT * FROM tasks WHERE task_id = ?", (rollout.task_id,)).fetchone()
    if rollout.prompt_token_ids != json.loads(task["prompt_token_ids"]):
        raise ApiError(
            422, f"prompt_token_ids differ from the prompt of task {rollout.task_id!r}", Reason.PROMPT
        )
    leased = SamplingParams.model_validate_json(lease["sampling"])
    if rollout.sampling != leased:
        detail = f"sampling {rollout.sampling.model_dump()} differs from the leased {leased.model_dump()}"
        raise ApiError(422, detail, Reason.SAMPLING)
    token_ids, versions = _model_tokens(context, rollout)
    check_images(context, rollout, task)
    _check_generation(context, rollout, token_ids)
    _check_versions(context, versions, latest_version(db))
    if replayed is None:
        check_traces(db, context, rollout)  # hashes and signatures only: before the replay
        return None
    if replayed.mismatch is not None:
        raise ApiError(422, replayed.mismatch, replayed.reason)
    assert replayed.messages is not None, "a rollout that passed every check was replayed before the lock"
    return Checked(rollout, replayed, min(versions), max(versions), len(token_ids))


def _store(db: Connection, worker_id: str, item: Checked, now: float) -> str:
    rollout = item.rollout
    rollout_id = f"{rollout.task_id}-{rollout.slot}"
    db.execute(
        "INSERT INTO rollouts (rollout_id, task_id, slot, lease_id, worker_id, payload, reward,"
        " min_version, max_version, num_model_tokens, accepted) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            rollout_id,
            rollout.task_id,
            rollout.slot,
            rollout.lease_id,
            worker_id,
            rollout.model_dump_json(exclude={"stage_traces"}),
            0.0,  # until scored (scoring.py); the group is not ready before
            item.min_version,
            item.max_version,
            item.num_model_tokens,
            now,
        ),
    )
    db.execute(
        "UPDATE slots SET rollout_id = ? WHERE task_id = ? AND slot = ?",
        (rollout_id, rollout.task_id, rollout.slot),
    )
    if rollout.stage_traces is not None:  # kept only if picked for verification (below)
        traces = json.dumps([trace.model_dump() for trace in rollout.stage_traces])
        db.execute("INSERT INTO stage_traces (rollout_id, traces) VALUES (?, ?)", (rollout_id, traces))
    return rollout_id


def _complete(db: Connection, task_ids: set[str], lease_ids: set[str]) -> int:
    """Mark fully answered leases done (and full groups ready, when nothing holds them back);
    return the number of groups this submission filled."""
    complete_tasks(db, task_ids)
    filled = sum(is_filled(db, task_id) for task_id in task_ids)
    for lease_id in lease_ids:
        unfilled = db.execute(
            "SELECT COUNT(*) FROM lease_slots ls JOIN slots s ON s.task_id = ls.task_id AND s.slot = ls.slot"
            " WHERE ls.lease_id = ? AND s.rollout_id IS NULL",
            (lease_id,),
        )
        if unfilled.fetchone()[0] == 0:
            db.execute("UPDATE leases SET state = 'done' WHERE lease_id = ?", (lease_id,))
    return filled


def _check_all(
    db: Connection,
    context: Context,
    worker_id: str,
    submission: RolloutSubmission,
    replayed: list[Replayed] | None,
) -> list[Checked]:
    now = context.clock()
    checked: list[Checked] = []
    seen: set[tuple[str, int]] = set()
    for index, rollout in enumerate(submission.rollouts):
        try:
            if (rollout.task_id, rollout.slot) in seen:
                raise ApiError(
                    409, f"task {rollout.task_id!r} slot {rollout.slot} appears twice", Reason.DUPLICATE
                )
            seen.add((rollout.task_id, rollout.slot))
            item = _check(db, context, worker_id, rollout, now, None if replayed is None else replayed[index])
            if item is not None:
                checked.append(item)
        except ApiError as error:
            raise ApiError(error.status, f"rollouts[{index}]: {error.detail}", error.reason) from None
    return checked


def _accept(
    db: Connection,
    context: Context,
    worker_id: str,
    submission: RolloutSubmission,
    replayed: list[Replayed],
) -> tuple[SubmissionResult, list[ScoreJob]]:
    now = context.clock()
    checked = _check_all(db, context, worker_id, submission, replayed)
    accepted = [_store(db, worker_id, item, now) for item in checked]
    stored = [(rollout_id, item.rollout.task_id) for rollout_id, item in zip(accepted, checked, strict=True)]
    trusted = worker_id == LOCAL_WORKER  # the trainer's own rollouts: nothing to judge or verify
    if not trusted:
        rollouts = [item.rollout for item in checked]
        _, tolerance = tolerances.worker_tolerance(db, context.tolerances, worker_id)
        if reputation.judge_repeats(db, context.run.trust, worker_id, rollouts, now, tolerance):
            # quarantined: discarded with the rest
            return SubmissionResult(accepted=[], groups_completed=0), []
    jobs = []
    for rollout_id, item in zip(accepted, checked, strict=True):
        seed, messages = item.replayed.seed, item.replayed.messages
        assert seed is not None and messages is not None  # _check refused any rollout not replayed
        job = ScoreJob(rollout_id, seed, "train", messages)
        context.scoring.pend(db, item.rollout.task_id, worker_id, job)
        jobs.append(job)
    picked = set() if trusted else verification.hold_sampled(db, context, worker_id, stored, now)
    unpicked = [(rollout_id,) for rollout_id, _ in stored if rollout_id not in picked]
    db.executemany("DELETE FROM stage_traces WHERE rollout_id = ?", unpicked)
    db.execute("UPDATE workers SET last_seen = ? WHERE worker_id = ?", (now, worker_id))
    task_ids = {item.rollout.task_id for item in checked}
    lease_ids = {item.rollout.lease_id for item in checked}
    result = SubmissionResult(accepted=accepted, groups_completed=_complete(db, task_ids, lease_ids))
    return result, jobs


def _refused(context: Context, worker_id: str, error: ApiError) -> None:
    """Count a refusal; a registered worker's also counts against it. The trainer's own rollouts
    (`LOCAL_WORKER`) are refused only for a bug or a lease that outlived its deadline: an event
    names them, and there is no reputation to charge."""
    if worker_id == LOCAL_WORKER:
        with context.store.transaction() as db:
            add_event(db, context.clock(), REJECTED, worker_id, error.reason)
    else:
        record_rejection(context, worker_id, error.reason)


def bind(context: Context, worker_id: str, submission: RolloutSubmission) -> None:
    """Refuse `submission` unless every rollout binds to an open slot of the worker's own lease and
    passes every check that needs no replay; stores nothing."""
    try:
        with context.store.transaction() as db:
            _check_all(db, context, worker_id, submission, None)
    except ApiError as error:
        _refused(context, worker_id, error)
        raise


def replay(context: Context, submission: RolloutSubmission) -> list[Replayed]:
    """The episodes of a bound submission, replayed from its token ids (environment code, outside
    the store's lock): the costly part of ingestion."""
    return replay_rollouts(context, submission.rollouts)


def submit(context: Context, worker_id: str, submission: RolloutSubmission) -> SubmissionResult:
    """bind, replay and accept in one call (the route runs them apart, to budget the replay)."""
    bind(context, worker_id, submission)
    return accept(context, worker_id, submission, replay(context, submission))


def accept(
    context: Context, worker_id: str, submission: RolloutSubmission, replayed: list[Replayed]
) -> SubmissionResult:
    """Store every rollout of a replayed `submission` or none of them; the answer follows the commit."""
    try:
        with context.store.transaction() as db:
            result, jobs = _accept(db, context, worker_id, submission, replayed)
    except ApiError as error:
        _refused(context, worker_id, error)
        raise
    # Only committed rollouts are scored, and never on this request's time (docs/rewards.md).
    context.scoring.enqueue(jobs, worker_id)
    return result
