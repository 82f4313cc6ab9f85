"""The coordinator's whole database schema, in one place, as numbered migrations.

`PRAGMA user_version` holds the number of migrations applied; `migrate` applies the missing ones in
order, each in its own transaction together with the new version number, so a crash mid-way leaves
the database at a whole version. A database created before versioning (version 0, tables present)
is adopted by migration 1, whose statements all read `IF NOT EXISTS`. A change to the schema is a
new entry at the end of `MIGRATIONS`, never an edit of an applied one. The SQL is plain enough
(TEXT, INTEGER, REAL, `?` parameters) for a second backend to translate rather than rewrite.

Tables: the task pipeline (tasks, slots, leases, lease_slots, rollouts, batches, train_metrics),
weights, the event log and meta; the trust layer (worker_keys, reputation, repeat_evidence,
verify_jobs, holds, repeat_references, nonces, rate_buckets; `coordinator/trust/`); peers and
peer_reports (`coordinator/weights/peers.py`); rewards (reward_pending, reward_scores, reward_steps,
reward_alarms; `coordinator/pipeline/scoring.py`); what the dashboard shows besides (trainer_logprobs,
weight_traffic; `monitor/records.py`); pipeline stages (stage_holders, lease_routes, stage_traces,
route_latency; `coordinator/stage_routing.py`) and served environments (env_servers, env_episodes).
"""

from __future__ import annotations

import sqlite3

MIGRATIONS: tuple[str, ...] = (
    """CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS workers (
    worker_id TEXT PRIMARY KEY, name TEXT NOT NULL, engine TEXT NOT NULL,
    token_sha256 TEXT NOT NULL UNIQUE, registered REAL NOT NULL, last_seen REAL NOT NULL);
CREATE TABLE IF NOT EXISTS tasks (
    seq INTEGER PRIMARY KEY, task_id TEXT NOT NULL UNIQUE, group_id TEXT NOT NULL UNIQUE,
    env TEXT NOT NULL, seed INTEGER NOT NULL, prompt_token_ids TEXT NOT NULL,
    num_slots INTEGER NOT NULL, state TEXT NOT NULL, created REAL NOT NULL, batch_id TEXT);
CREATE INDEX IF NOT EXISTS tasks_state ON tasks (state);
CREATE TABLE IF NOT EXISTS slots (
    task_id TEXT NOT NULL, slot INTEGER NOT NULL, lease_id TEXT, rollout_id TEXT,
    PRIMARY KEY (task_id, slot));
CREATE INDEX IF NOT EXISTS slots_lease ON slots (lease_id);
CREATE TABLE IF NOT EXISTS leases (
    lease_id TEXT PRIMARY KEY, worker_id TEXT NOT NULL, created REAL NOT NULL,
    deadline REAL NOT NULL, sampling TEXT NOT NULL, state TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS leases_state ON leases (state, deadline);
CREATE TABLE IF NOT EXISTS lease_slots (
    lease_id TEXT NOT NULL, task_id TEXT NOT NULL, slot INTEGER NOT NULL,
    PRIMARY KEY (lease_id, task_id, slot));
CREATE TABLE IF NOT EXISTS rollouts (
    seq INTEGER PRIMARY KEY, rollout_id TEXT NOT NULL UNIQUE, task_id TEXT NOT NULL,
    slot INTEGER NOT NULL, lease_id TEXT NOT NULL, worker_id TEXT NOT NULL, payload TEXT NOT NULL,
    reward REAL NOT NULL, min_version INTEGER NOT NULL, max_version INTEGER NOT NULL,
    num_model_tokens INTEGER NOT NULL, accepted REAL NOT NULL, staleness INTEGER);
CREATE INDEX IF NOT EXISTS rollouts_task ON rollouts (task_id);
CREATE INDEX IF NOT EXISTS rollouts_accepted ON rollouts (accepted);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY, batch_id TEXT NOT NULL UNIQUE, state TEXT NOT NULL,
    group_ids TEXT NOT NULL, trainer_version INTEGER NOT NULL, acked_version INTEGER,
    num_groups_expired INTEGER NOT NULL, created REAL NOT NULL, acked REAL);
CREATE TABLE IF NOT EXISTS weights (
    version INTEGER PRIMARY KEY, path TEXT NOT NULL, sha256 TEXT NOT NULL,
    num_bytes INTEGER NOT NULL, created REAL NOT NULL, pruned INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY, ts REAL NOT NULL, kind TEXT NOT NULL, worker_id TEXT,
    reason TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS events_kind ON events (kind, reason);
CREATE TABLE IF NOT EXISTS train_metrics (
    version INTEGER PRIMARY KEY, ts REAL NOT NULL, metrics TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS worker_keys (
    worker_id TEXT PRIMARY KEY, public_key TEXT NOT NULL UNIQUE, address TEXT, registered REAL NOT NULL);
CREATE TABLE IF NOT EXISTS reputation (
    worker_id TEXT PRIMARY KEY, violations INTEGER NOT NULL DEFAULT 0,
    verified INTEGER NOT NULL DEFAULT 0, logprob_failures INTEGER NOT NULL DEFAULT 0,
    tokens_verified INTEGER NOT NULL DEFAULT 0, block INTEGER NOT NULL DEFAULT 1,
    block_tokens INTEGER NOT NULL DEFAULT 0,
    block_sums TEXT NOT NULL DEFAULT '[]', p_value REAL NOT NULL DEFAULT 1.0,
    score REAL NOT NULL DEFAULT 1.0, quarantined REAL, reason TEXT);
CREATE TABLE IF NOT EXISTS repeat_evidence (
    worker_id TEXT PRIMARY KEY, submissions INTEGER NOT NULL, detector REAL NOT NULL);
CREATE TABLE IF NOT EXISTS verify_jobs (
    rollout_id TEXT PRIMARY KEY, submission_id TEXT NOT NULL, worker_id TEXT NOT NULL,
    state TEXT NOT NULL, pit_seed INTEGER NOT NULL, created REAL NOT NULL, claimed REAL, verdict TEXT);
CREATE INDEX IF NOT EXISTS verify_jobs_state ON verify_jobs (state, claimed);
CREATE INDEX IF NOT EXISTS verify_jobs_submission ON verify_jobs (submission_id);
CREATE TABLE IF NOT EXISTS holds (
    rollout_id TEXT PRIMARY KEY, task_id TEXT NOT NULL, submission_id TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS holds_task ON holds (task_id);
CREATE INDEX IF NOT EXISTS holds_submission ON holds (submission_id);
""",
    # Rewards scored off the request path (coordinator/pipeline/scoring.py): a rollout's pending
    # job until every rubric term is in, each rollout's term scores and diagnostics, the trainer
    # steps the reward-hacking monitors read, and the alarms they raised.
    """CREATE TABLE reward_pending (
    rollout_id TEXT PRIMARY KEY, task_id TEXT NOT NULL, worker_id TEXT NOT NULL, job TEXT NOT NULL,
    state TEXT NOT NULL, terms TEXT);
CREATE INDEX reward_pending_task ON reward_pending (task_id);
CREATE INDEX reward_pending_state ON reward_pending (state);
CREATE TABLE reward_scores (
    seq INTEGER PRIMARY KEY, rollout_id TEXT NOT NULL UNIQUE, worker_id TEXT NOT NULL, reward REAL NOT NULL,
    terms TEXT NOT NULL, diagnostics TEXT NOT NULL, flags TEXT NOT NULL, failure TEXT, ts REAL NOT NULL);
CREATE INDEX reward_scores_ts ON reward_scores (ts);
CREATE TABLE reward_steps (
    version INTEGER PRIMARY KEY, ts REAL NOT NULL, last_score INTEGER NOT NULL, reward REAL NOT NULL,
    answer_chars REAL NOT NULL, repetition REAL NOT NULL, heldout REAL);
CREATE TABLE reward_alarms (
    seq INTEGER PRIMARY KEY, ts REAL NOT NULL, version INTEGER, alarm TEXT NOT NULL, worker_id TEXT,
    detail TEXT NOT NULL);
CREATE INDEX reward_alarms_alarm ON reward_alarms (alarm, worker_id, version);
""",
    # Service and identity hardening (docs/security.md): nonces of signed state-changing requests and
    # rate-limit buckets survive restarts; per-worker repeated-completion references across
    # submissions; indexes for the per-worker lease allowance.
    """CREATE TABLE IF NOT EXISTS nonces (
    identity TEXT NOT NULL, nonce TEXT NOT NULL, expires REAL NOT NULL, PRIMARY KEY (identity, nonce));
CREATE INDEX IF NOT EXISTS nonces_expires ON nonces (expires);
CREATE TABLE IF NOT EXISTS rate_buckets (
    limiter TEXT NOT NULL, key TEXT NOT NULL, tokens REAL NOT NULL, last REAL NOT NULL,
    PRIMARY KEY (limiter, key));
CREATE TABLE IF NOT EXISTS repeat_references (
    worker_id TEXT NOT NULL, task_id TEXT NOT NULL, digest TEXT NOT NULL, PRIMARY KEY (worker_id, task_id));
CREATE INDEX IF NOT EXISTS leases_worker ON leases (worker_id, state);
CREATE INDEX IF NOT EXISTS rollouts_worker ON rollouts (worker_id, accepted);
""",
    # 4: what the dashboard shows beyond the run's own state (monitor/records.py).
    """CREATE TABLE trainer_logprobs (
    rollout_id TEXT PRIMARY KEY, version INTEGER NOT NULL, logprobs TEXT NOT NULL);
CREATE TABLE weight_traffic (
    version INTEGER NOT NULL, worker_id TEXT NOT NULL, coordinator_bytes INTEGER NOT NULL,
    peer_bytes INTEGER NOT NULL, PRIMARY KEY (version, worker_id));
""",
    # 5: peer lists in the store, so that every replica of a run lists the same peers.
    """CREATE TABLE peers (
    worker_id TEXT PRIMARY KEY, url TEXT NOT NULL, version INTEGER NOT NULL, seen REAL NOT NULL);
CREATE TABLE peer_reports (
    peer TEXT NOT NULL, reporter TEXT NOT NULL, established INTEGER NOT NULL, PRIMARY KEY (peer, reporter));
""",
    # 6: the engine class a worker declares (with `engine`), whose log-prob tolerance it is held to,
    # and its mean test's detector over verdict batches (trust/logprob_tolerance.py).
    """ALTER TABLE workers ADD COLUMN dtype TEXT NOT NULL DEFAULT 'float32';
ALTER TABLE workers ADD COLUMN device TEXT NOT NULL DEFAULT 'cpu';
ALTER TABLE reputation ADD COLUMN error_batches INTEGER NOT NULL DEFAULT 0;
ALTER TABLE reputation ADD COLUMN error_detector REAL;
""",
    # 7: the version test's detector over verdict batches (verifier/version_check.py).
    """ALTER TABLE reputation ADD COLUMN version_batches INTEGER NOT NULL DEFAULT 0;
ALTER TABLE reputation ADD COLUMN version_detector REAL;
""",
    # 8: pipeline stages (coordinator/stage_holders.py): who serves which stage where, and each
    # leased route's holders (a holder asks who drives a lease it is on; routing counts its load).
    """CREATE TABLE stage_holders (
    worker_id TEXT PRIMARY KEY, stage INTEGER NOT NULL, url TEXT NOT NULL, version INTEGER NOT NULL,
    held_versions TEXT NOT NULL, tokens_per_second REAL NOT NULL, seen REAL NOT NULL, down_until REAL NOT NULL DEFAULT 0);
CREATE TABLE lease_routes (
    lease_id TEXT NOT NULL, stage INTEGER NOT NULL, worker_id TEXT NOT NULL, version INTEGER NOT NULL,
    PRIMARY KEY (lease_id, stage));
CREATE INDEX lease_routes_worker ON lease_routes (worker_id);
CREATE TABLE stage_traces (rollout_id TEXT PRIMARY KEY, traces TEXT NOT NULL);
""",
    # 9: holders reached through the coordinator's relay (coordinator/stage_relay.py): no address
    # announced (url ''), or one the coordinator could not connect to.
    """ALTER TABLE stage_holders ADD COLUMN relayed INTEGER NOT NULL DEFAULT 0;
""",
    # 10: served environments (coordinator/env_servers.py): the env servers of the run with their
    # signing keys, every episode granted for a leased slot (the key that signs it, whether it
    # failed), and each task's failed episodes.
    """CREATE TABLE env_servers (
    server_id TEXT PRIMARY KEY, url TEXT NOT NULL, public_key TEXT NOT NULL, env TEXT NOT NULL,
    env_version TEXT NOT NULL, sessions INTEGER NOT NULL, open_episodes INTEGER NOT NULL,
    counters TEXT NOT NULL, seen REAL NOT NULL);
CREATE TABLE env_episodes (
    episode_id TEXT PRIMARY KEY, lease_id TEXT NOT NULL, task_id TEXT NOT NULL, slot INTEGER NOT NULL,
    attempt INTEGER NOT NULL, server_id TEXT NOT NULL, server_key TEXT NOT NULL, env_version TEXT NOT NULL,
    state TEXT NOT NULL, reason TEXT, created REAL NOT NULL);
CREATE INDEX env_episodes_slot ON env_episodes (lease_id, task_id, slot);
CREATE INDEX env_episodes_state ON env_episodes (state);
ALTER TABLE tasks ADD COLUMN env_failures INTEGER NOT NULL DEFAULT 0;
""",
    # 11: measured routes (coordinator/route_latency.py): each driver's smoothed decode-step round
    # trip to each holder it was routed through, and per leased hop the driver's report (NULL until
    # it reports, which it may do once).
    """CREATE TABLE route_latency (
    driver_id TEXT NOT NULL, holder_id TEXT NOT NULL, step_ms REAL NOT NULL, steps INTEGER NOT NULL,
    reports INTEGER NOT NULL, updated REAL NOT NULL, PRIMARY KEY (driver_id, holder_id));
CREATE INDEX route_latency_holder ON route_latency (holder_id);
ALTER TABLE lease_routes ADD COLUMN step_ms REAL;
""",
)


class SchemaTooNew(RuntimeError):
    """The database was written by a newer decentrl than this one."""


def schema_version(db: sqlite3.Connection) -> int:
    return int(db.execute("PRAGMA user_version").fetchone()[0])


def migrate(db: sqlite3.Connection) -> int:
    """Bring the database to the latest schema; returns the version it is at."""
    current = schema_version(db)
    if current > len(MIGRATIONS):
        raise SchemaTooNew(
            f"the coordinator database has schema version {current}, newer than this decentrl's "
            f"{len(MIGRATIONS)}; run the coordinator with the decentrl that created the run"
        )
    for version in range(current + 1, len(MIGRATIONS) + 1):
        # executescript commits any open transaction first; BEGIN..COMMIT makes the step atomic.
        db.executescript(
            f"BEGIN IMMEDIATE;\n{MIGRATIONS[version - 1]}\nPRAGMA user_version = {version};\nCOMMIT;"
        )
    return len(MIGRATIONS)
