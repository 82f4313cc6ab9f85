"""Tasks, slots and leases.

A task is one environment problem whose group of `group_size` rollouts is the unit of advantage
estimation; each sample index is a slot. A lease hands a worker some slots until a deadline.
Slots of a lease that expires unfilled become open again and are leased first, before any new
task is created, so that groups complete and the work in flight stays bounded by
`max_pending_groups`.
"""

from __future__ import annotations

import json
import math
import secrets
from collections import defaultdict

from decentrl.coordinator.context import Context
from decentrl.coordinator.db.store import (
    LEASE_EXPIRED,
    PROMPT_SKIPPED,
    add_event,
    count_untrained_groups,
    latest_version,
    next_counter,
)
from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.coordinator.stage_routing import check_stage, pick_route, record_route
from decentrl.dbapi import Connection
from decentrl.monitor import records
from decentrl.protocol import Lease, LeaseRequest, TaskSpec

LOCAL_WORKER = "trainer"
"""The worker id of the trainer's own (colocated) rollouts in the store: leased and submitted with the
trainer token, never a registered worker's id (those are `NAME-HEX`)."""

# Train seeds of run seed s are s * SEED_STRIDE + 0, 1, 2, ... so that runs with different seeds
# see different task streams while one run's stream is reproducible.
SEED_STRIDE = 1_000_000_000


def sweep_expired(db: Connection, now: float) -> int:
    """Expire open leases past their deadline and free their unfilled slots; one event per lease."""
    expired = db.execute(
        "SELECT lease_id, worker_id FROM leases WHERE state = 'open' AND deadline < ?", (now,)
    ).fetchall()
    for lease in expired:
        db.execute("UPDATE leases SET state = 'expired' WHERE lease_id = ?", (lease["lease_id"],))
        db.execute(
            "UPDATE slots SET lease_id = NULL WHERE lease_id = ? AND rollout_id IS NULL", (lease["lease_id"],)
        )
        add_event(db, now, LEASE_EXPIRED, lease["worker_id"], "deadline passed")
    return len(expired)


def sweep(context: Context) -> int:
    with context.store.transaction() as db:
        return sweep_expired(db, context.clock())


def check_policy_version(db: Connection, context: Context, version: int) -> None:
    latest = latest_version(db)
    if latest is None:
        raise ApiError(
            503,
            "no policy version published yet; retry once the trainer publishes version 0",
            Reason.NOT_READY,
        )
    if version > latest:
        raise ApiError(
            409, f"policy version {version} is not published; the latest is {latest}", Reason.STALE
        )
    oldest = latest - context.config.max_staleness
    if version < oldest:
        raise ApiError(
            409,
            f"policy version {version} is too stale: latest is {latest} and max_staleness is "
            f"{context.config.max_staleness}; load version >= {oldest} (GET /v1/weights/latest)",
            Reason.STALE,
        )


def _open_slots(db: Connection, max_groups: int) -> dict[str, list[int]]:
    """Unfilled, unleased slots of pending tasks (their earlier lease expired), oldest task first."""
    rows = db.execute(
        "SELECT s.task_id, s.slot FROM slots s JOIN tasks t ON t.task_id = s.task_id"
        " WHERE t.state = 'pending' AND s.lease_id IS NULL AND s.rollout_id IS NULL"
        " ORDER BY t.seq, s.slot"
    ).fetchall()
    picked: dict[str, list[int]] = defaultdict(list)
    for row in rows:
        if row["task_id"] in picked or len(picked) < max_groups:
            picked[row["task_id"]].append(row["slot"])
    return dict(picked)


# Consecutive train prompts too long for the context before leasing gives up (the start-up
# check, context.check_prompts_fit, has seen at least one of the first that fits)
MAX_PROMPTS_SKIPPED = 1_000


def _new_task(db: Connection, context: Context, now: float) -> tuple[str, list[int]]:
    limit, budget = context.model.max_context, context.config.max_new_tokens
    for _ in range(MAX_PROMPTS_SKIPPED):
        index = next_counter(db, "next_task")
        seed = context.run.seed * SEED_STRIDE + index
        problem = context.env.problem(seed, "train")
        prompt_ids = context.chat.prompt_ids(problem.prompt, context.env.tools or None)
        if limit is None or len(prompt_ids) + budget <= limit:
            break
        # as verl's filter_overlong_prompts: the problem is never trained, and the event says so
        reason = f"train seed {seed}: {len(prompt_ids)} prompt tokens + {budget} new > context {limit}"
        add_event(db, now, PROMPT_SKIPPED, None, reason)
    else:
        raise ApiError(
            503,
            f"the last {MAX_PROMPTS_SKIPPED} train prompts do not fit the model's context of {limit} tokens",
            Reason.NOT_READY,
        )
    task_id, group_size = f"t{index:07d}", context.config.group_size
    db.execute(
        "INSERT INTO tasks (task_id, group_id, env, seed, prompt_token_ids, num_slots, state, created)"
        " VALUES (?, ?, ?, ?, ?, ?, 'pending', ?)",
        (task_id, f"g{index:07d}", context.run.task.env, seed, json.dumps(prompt_ids), group_size, now),
    )
    db.executemany(
        "INSERT INTO slots (task_id, slot) VALUES (?, ?)", [(task_id, slot) for slot in range(group_size)]
    )
    return task_id, list(range(group_size))


def _pick_slots(db: Connection, context: Context, max_groups: int, now: float) -> dict[str, list[int]]:
    picked = _open_slots(db, max_groups)
    untrained = count_untrained_groups(db)
    while len(picked) < max_groups and untrained < context.config.max_pending_groups:
        task_id, slots = _new_task(db, context, now)
        picked[task_id] = slots
        untrained += 1
    return picked


def _task_spec(db: Connection, task_id: str, slots: list[int]) -> TaskSpec:
    task = db.execute("SELECT * FROM tasks WHERE task_id = ?", (task_id,)).fetchone()
    return TaskSpec(
        task_id=task_id,
        group_id=task["group_id"],
        env=task["env"],
        prompt_token_ids=json.loads(task["prompt_token_ids"]),
        slots=slots,
        seed=task["seed"],
    )


def lease_allowance(db: Connection, context: Context, worker_id: str, now: float) -> int:
    """Groups `worker_id` may lease now: its cap minus the groups it holds (below).

    The cap grows with what the worker delivered (accepted and scored): a newcomer may hold
    `trust.lease_groups_new` groups, one more per group's worth of rollouts delivered, up to
    `trust.lease_groups_floor`; past that, twice the groups' worth it delivered within the last
    `lease_seconds` (its measured throughput). And, beside other workers holding groups, never
    more than a share of `max_pending_groups` split between them, itself and one more, so that a
    few identities that lease and never answer cannot fill the run's room for open groups."""
    trust, group_size = context.run.trust, context.config.group_size
    # Held: groups with a slot leased to it and unanswered, or with a rollout of it whose reward is
    # still pending (a worker whose rollouts are slow to score holds the room they take).
    open_groups = db.execute(
        "SELECT COUNT(*) FROM (SELECT ls.task_id FROM leases l"
        " JOIN lease_slots ls ON ls.lease_id = l.lease_id"
        " JOIN slots s ON s.task_id = ls.task_id AND s.slot = ls.slot"
        " WHERE l.worker_id = ? AND l.state = 'open' AND s.rollout_id IS NULL"
        " UNION SELECT task_id FROM reward_pending WHERE worker_id = ?) AS held",
        (worker_id, worker_id),
    ).fetchone()[0]
    accepted, recent = db.execute(
        "SELECT COUNT(*), COALESCE(SUM(CASE WHEN accepted > ? THEN 1 ELSE 0 END), 0) FROM rollouts"
        " WHERE worker_id = ?",
        (now - context.config.lease_seconds, worker_id),
    ).fetchone()
    # Delivered means scored: rollouts whose reward is pending (code that sleeps to the sandbox's
    # limit, say) earn nothing yet. They are recent, so they come off both counts.
    pending = "SELECT COUNT(*) FROM reward_pending WHERE worker_id = ?"
    unscored = db.execute(pending, (worker_id,)).fetchone()[0]
    delivered, recent = accepted - unscored, max(0, recent - unscored)
    earned = min(trust.lease_groups_floor, trust.lease_groups_new + delivered // group_size)
    cap = max(earned, 2 * math.ceil(recent / group_size))
    others = {
        row[0]
        for row in db.execute(
            "SELECT worker_id FROM leases WHERE state = 'open' AND deadline >= ?"
            " UNION SELECT worker_id FROM reward_pending",
            (now,),
        )
    } - {worker_id}
    # Alone, a worker may fill the room; beside others, one share is kept for a worker yet to come,
    # so that holders that never answer cannot fill it.
    room = context.config.max_pending_groups
    fair = math.ceil(room / (len(others) + 2)) if others else room
    return min(cap, fair) - open_groups


def grant_lease(
    context: Context, worker_id: str, request: LeaseRequest, trusted: bool = False
) -> Lease | None:
    """A lease over up to `request.max_groups` tasks, or None when there is nothing to do now (or the
    worker already holds as many open groups as it may, see `lease_allowance`). A `trusted` lease
    (the trainer's own rollouts, `LOCAL_WORKER`) is bounded only by `max_pending_groups`."""
    now = context.clock()
    with context.store.transaction() as db:
        if request.weights_received is not None:  # for the dashboard only: self-reported
            records.store_weights_received(db, worker_id, request.weights_received)
        check_policy_version(db, context, request.policy_version)
        sweep_expired(db, now)
        db.execute("UPDATE workers SET last_seen = ? WHERE worker_id = ?", (now, worker_id))
        assert not trusted or worker_id == LOCAL_WORKER, "only the trainer's own leases are trusted"
        allowance = request.max_groups if trusted else lease_allowance(db, context, worker_id, now)
        if allowance <= 0:
            return None
        route = None
        if context.stage_map is not None and request.stage is None:
            detail = (
                "this run is staged: only a worker holding stage 0 leases tasks (decentrl worker --stage 0)"
            )
            raise ApiError(422, detail, Reason.STAGE)
        if request.stage is not None:  # a driver: its lease runs through one holder per later stage
            check_stage(context, request.stage, "the lease request")
            route = pick_route(db, context, worker_id, request.policy_version, now)
            if route is None:  # some stage has no live holder at this version yet
                return None
        picked = _pick_slots(db, context, min(request.max_groups, allowance), now)
        if not picked:
            return None
        lease = Lease(
            lease_id=f"l-{secrets.token_hex(8)}",
            deadline_unix=now + context.config.lease_seconds,
            sampling=context.sampling,
            tasks=[_task_spec(db, task_id, slots) for task_id, slots in picked.items()],
            route=route,
            policy_version=None if route is None else request.policy_version,
        )
        if route is not None:
            record_route(db, lease.lease_id, route, request.policy_version)
        db.execute(
            "INSERT INTO leases (lease_id, worker_id, created, deadline, sampling, state)"
            " VALUES (?, ?, ?, ?, ?, 'open')",
            (lease.lease_id, worker_id, now, lease.deadline_unix, lease.sampling.model_dump_json()),
        )
        rows = [(lease.lease_id, task_id, slot) for task_id, slots in picked.items() for slot in slots]
        db.executemany("INSERT INTO lease_slots (lease_id, task_id, slot) VALUES (?, ?, ?)", rows)
        db.executemany("UPDATE slots SET lease_id = ? WHERE task_id = ? AND slot = ?", rows)
    return lease
