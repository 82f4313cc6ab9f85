"""Trusted rewards off the request path: the rubric in the scoring pool, remote terms from scorers.

Ingestion replays each episode (cheap, deterministic: a mismatch is the worker's fault and is
refused at once) and commits the rollout with a `reward_pending` row holding its score job. Only
then is the job handed to the scoring pool (`rewards/pool.py`), so a slow or hung scorer never
holds a worker's submission, the store's lock or a request thread: the answer to a submission
never waits for a reward. When the pool answers, the rubric's local terms are stored; terms
scored by a trusted helper (a reward model: `decentrl scorer`) are handed out as jobs
(`POST /v1/scorer/jobs`) and posted back (`/v1/scorer/scores`). Once every term is in, the
rubric combines them (`rewards.rubric.combine`), the rollout's reward is written and its group
may become ready (`db.store.complete_tasks` waits for every pending reward of a group).

A scoring failure (timeout, crash, oversized output, exception) rejects that rollout: a
`rejected` event with reason `scoring_failed`, counted with every other rejection, and a
`reward_failed` event naming the failure; its slot is leased again, so the group is never trained
on a reward nobody computed. A known hack pattern in the answer is a
`reward_alarm` and, with `reward.zero_flagged`, zeroes the reward. Pending jobs are durable: a
restarted coordinator scores them again (`resume`).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Callable
from functools import partial

from decentrl.config import RunConfig
from decentrl.config.rewards import REMOTE_FUNCTIONS
from decentrl.coordinator.db.store import REJECTED, Database, add_event, complete_tasks, discard_rollout
from decentrl.coordinator.http.errors import Reason
from decentrl.dbapi import Connection
from decentrl.envs.base import Environment, final_answer
from decentrl.envs.registry import task_arguments
from decentrl.protocol import ScoreJob as WireScoreJob
from decentrl.protocol import ScoreJobs, ScoreJobsRequest, TermScoreBatch
from decentrl.rewards.monitors import Alarm
from decentrl.rewards.pool import ScoringFailure, ScoringPool
from decentrl.rewards.rubric import ScoreJob, TermScores, combine, rubric_scorer

log = logging.getLogger(__name__)

WRITE_BURST = 512
"""Most results stored in one transaction."""
REWARD_FAILED = "reward_failed"
REWARD_ALARM = "reward_alarm"
REMOTE_JOB_SECONDS = 60.0  # a scorer job taken and not answered within this is handed out again


def record_alarm(
    db: Connection,
    now: float,
    alarm: Alarm,
    worker_id: str | None,
    detail: str,
    version: int | None = None,
) -> None:
    """One alarm: an event (counted on /v1/stats and /metrics) and a detailed row for the trainer log."""
    add_event(db, now, REWARD_ALARM, worker_id, alarm.value)
    db.execute(
        "INSERT INTO reward_alarms (ts, version, alarm, worker_id, detail) VALUES (?, ?, ?, ?, ?)",
        (now, version, alarm.value, worker_id, detail),
    )
    log.warning("reward alarm %s%s: %s", alarm.value, f" (worker {worker_id})" if worker_id else "", detail)


class RewardScoring:
    def __init__(self, run: RunConfig, store: Database, env: Environment, clock: Callable[[], float]) -> None:
        self.run = run
        self.store = store
        self.env = env
        self.clock = clock
        self.config = run.reward
        self.remote = [t.label for t in self.config.terms if t.function in REMOTE_FUNCTIONS]
        self._pool: ScoringPool | None = None
        self._lock = threading.Lock()
        self._results: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        self.charge: Callable[[str, float], None] | None = None
        """Told (worker id, seconds) of every pool call: the submitting worker's scoring budget
        (`scoring_budget.py`) pays for the rewards of its rollouts as for their replay."""
        self.on_stored: Callable[[], None] | None = None
        """Called after each burst of results commits (groups may have become ready)."""

    @property
    def pool(self) -> ScoringPool:
        return self.prepare()

    def prepare(self) -> ScoringPool:
        """The pool, started now if it is not yet: at the first worker's registration, the
        trainer's first `/v1/info` or the first rollout, whichever comes first (a coordinator that
        never scores spawns nothing; one with a worker, or a colocated trainer, has its scorers
        imported by the time the first rollouts arrive)."""
        with self._lock:
            if self._pool is None:
                task = self.run.task
                args = task_arguments(task, self.run.sandbox)  # code is scored under the run's [sandbox]
                factory = partial(rubric_scorer, task.env, args, self.config.model_dump_json())
                self._pool = ScoringPool(
                    factory,
                    size=self.config.pool_size,
                    timeout_seconds=self.config.timeout_seconds,
                    max_output_bytes=self.config.max_output_bytes,
                    max_memory_mb=self.config.max_memory_mb,
                    start_now=True,
                )
            return self._pool

    def pend(self, db: Connection, task_id: str, worker_id: str, job: ScoreJob) -> None:
        """Record a job in the ingestion transaction (durable with its rollout)."""
        payload = json.dumps({"seed": job.seed, "split": job.split, "messages": job.messages})
        db.execute(
            "INSERT INTO reward_pending (rollout_id, task_id, worker_id, job, state) VALUES (?, ?, ?, ?, 'local')",
            (job.rollout_id, task_id, worker_id, payload),
        )

    def enqueue(self, jobs: list[ScoreJob], worker_id: str) -> None:
        """Hand committed jobs of `worker_id` to the pool; their results are stored by the writer
        thread, and the seconds each took in the pool are charged to the worker."""
        self._start_writer()
        charge = None if self.charge is None else partial(self.charge, worker_id)
        for job in jobs:
            self.pool.submit(job, charge, key=worker_id).add_done_callback(
                lambda future, job=job: self._results.put((job, future.result()))
            )

    def _start_writer(self) -> None:
        with self._lock:
            if self._writer is None:
                self._writer = threading.Thread(target=self._write, name="reward-writer", daemon=True)
                self._writer.start()

    def _write(self) -> None:
        """Store results as they come, every result waiting at that moment in one transaction: one
        commit (one fsync) per burst instead of one per rollout. A reward is never promised to a
        client before it is stored (its job was durable with the rollout), so batching them keeps
        every guarantee."""
        while (first := self._results.get()) is not None:
            burst = [first]
            while not self._results.empty() and len(burst) < WRITE_BURST:
                item = self._results.get_nowait()
                if item is None:
                    self._results.put(None)  # stop after this burst
                    break
                burst.append(item)
            self._stored(burst)

    def resume(self) -> int:
        """Send every job still pending in the pool's care (after a restart) to the pool again."""
        with self.store.transaction() as db:
            query = "SELECT rollout_id, worker_id, job FROM reward_pending WHERE state = 'local'"
            rows = db.execute(query).fetchall()
        for row in rows:
            self.enqueue([ScoreJob(row["rollout_id"], **json.loads(row["job"]))], row["worker_id"])
        return len(rows)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None
            writer, self._writer = self._writer, None
        if writer is not None:
            self._results.put(None)
            writer.join(30)

    def _stored(self, results: list[tuple[ScoreJob, TermScores | ScoringFailure]]) -> None:
        try:
            with self.store.transaction() as db:
                for job, result in results:
                    self._record(db, job.rollout_id, result)
        except Exception:  # the store closed under a late result (shutdown): they are rescored on restart
            log.exception("could not store the scores of %d rollouts", len(results))
            return
        if self.on_stored is not None:
            self.on_stored()

    def _record(self, db: Connection, rollout_id: str, result: TermScores | ScoringFailure) -> None:
        row = db.execute("SELECT * FROM reward_pending WHERE rollout_id = ?", (rollout_id,)).fetchone()
        if row is None:  # discarded meanwhile (its worker was quarantined)
            return
        now = self.clock()
        if isinstance(result, ScoringFailure):
            # Not a strike: a scorer can time out or crash on an honest answer.
            add_event(db, now, REWARD_FAILED, row["worker_id"], result.kind.value)
            add_event(db, now, REJECTED, row["worker_id"], Reason.SCORING_FAILED)
            log.warning(
                "rollout %s rejected, scoring failed: %s: %s", rollout_id, result.kind.value, result.detail
            )
            discard_rollout(db, rollout_id)
            return
        for flag in result.flags:
            record_alarm(db, now, Alarm.HACK_PATTERN, row["worker_id"], f"{flag} in rollout {rollout_id}")
        if self.remote:
            partial_scores = {
                "terms": result.terms,
                "diagnostics": result.diagnostics,
                "flags": list(result.flags),
            }
            db.execute(
                "UPDATE reward_pending SET state = 'remote', terms = ? WHERE rollout_id = ?",
                (json.dumps(partial_scores), rollout_id),
            )
            return
        self._finish(db, row, result.terms, result.diagnostics, result.flags)

    def _finish(self, db, row, terms: dict, diagnostics: dict, flags) -> None:
        reward = combine(self.config.terms, terms)
        if flags and self.config.zero_flagged:
            reward = 0.0
        rollout_id = row["rollout_id"]
        db.execute("UPDATE rollouts SET reward = ? WHERE rollout_id = ?", (reward, rollout_id))
        db.execute(
            "INSERT OR REPLACE INTO reward_scores (rollout_id, worker_id, reward, terms, diagnostics, flags,"
            " ts) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                rollout_id,
                row["worker_id"],
                reward,
                json.dumps(terms),
                json.dumps(diagnostics),
                json.dumps(list(flags)),
                self.clock(),
            ),
        )
        db.execute("DELETE FROM reward_pending WHERE rollout_id = ?", (rollout_id,))
        complete_tasks(db, {row["task_id"]})

    # ------------------------------------------------------------ remote terms (decentrl scorer)

    def next_jobs(self, request: ScoreJobsRequest) -> ScoreJobs:
        now = self.clock()
        terms = [t for t in self.remote if request.term in (None, t)]
        jobs: list[WireScoreJob] = []
        with self.store.transaction() as db:
            rows = db.execute(
                "SELECT rollout_id, job, terms FROM reward_pending WHERE state = 'remote'"
                " ORDER BY rowid LIMIT ?",
                (max(1, 8 * request.max_jobs),),
            ).fetchall()
            for row in rows:
                partial_scores = json.loads(row["terms"])
                claims = partial_scores.get("claimed", {})
                # Each term is claimed on its own: a scorer that took a job and died frees it after a while.
                wanted = [
                    t
                    for t in terms
                    if t not in partial_scores["terms"]
                    and claims.get(t, float("-inf")) < now - REMOTE_JOB_SECONDS
                ]
                if not wanted:
                    continue
                job = json.loads(row["job"])
                prompt = self.env.problem(job["seed"], job["split"]).text
                answer = final_answer(job["messages"])
                for term in wanted:
                    jobs.append(
                        WireScoreJob(rollout_id=row["rollout_id"], term=term, prompt=prompt, answer=answer)
                    )
                    claims[term] = now
                partial_scores["claimed"] = claims
                db.execute(
                    "UPDATE reward_pending SET terms = ? WHERE rollout_id = ?",
                    (json.dumps(partial_scores), row["rollout_id"]),
                )
                if len(jobs) >= request.max_jobs:
                    break
        return ScoreJobs(jobs=jobs)

    def record_scores(self, batch: TermScoreBatch) -> dict:
        finished = 0
        with self.store.transaction() as db:
            for score in batch.scores:
                row = db.execute(
                    "SELECT * FROM reward_pending WHERE rollout_id = ? AND state = 'remote'",
                    (score.rollout_id,),
                ).fetchone()
                if row is None or score.term not in self.remote:
                    continue  # already finished, discarded, or not a remote term: ignored
                partial_scores = json.loads(row["terms"])
                partial_scores["terms"][score.term] = score.value
                if all(term in partial_scores["terms"] for term in self.remote):
                    self._finish(
                        db,
                        row,
                        partial_scores["terms"],
                        partial_scores["diagnostics"],
                        tuple(partial_scores["flags"]),
                    )
                    finished += 1
                else:
                    db.execute(
                        "UPDATE reward_pending SET terms = ? WHERE rollout_id = ?",
                        (json.dumps(partial_scores), score.rollout_id),
                    )
        return {"finished": finished}


RECENT_SCORES = 200  # term and diagnostic means on /v1/stats cover this many latest scored rollouts
RECENT_ALARMS = 10


def summary(db: Connection) -> dict:
    """The `reward` section of /v1/stats: pending and failed scoring, alarms, recent term means."""
    rows = db.execute(
        "SELECT terms, diagnostics FROM reward_scores WHERE failure IS NULL ORDER BY seq DESC LIMIT ?",
        (RECENT_SCORES,),
    ).fetchall()
    sums: dict[str, dict[str, list[float]]] = {"terms": {}, "diagnostics": {}}
    for row in rows:
        for section in ("terms", "diagnostics"):
            for key, value in json.loads(row[section]).items():
                sums[section].setdefault(key, []).append(value)
    means = {
        section: {k: sum(v) / len(v) for k, v in sorted(found.items())} for section, found in sums.items()
    }

    def counts(kind: str) -> dict[str, int]:
        query = "SELECT reason, COUNT(*) AS n FROM events WHERE kind = ? GROUP BY reason ORDER BY reason"
        return {row["reason"]: row["n"] for row in db.execute(query, (kind,))}

    recent = db.execute(
        "SELECT ts, version, alarm, worker_id, detail FROM reward_alarms ORDER BY seq DESC LIMIT ?",
        (RECENT_ALARMS,),
    )
    return {
        "pending": int(db.execute("SELECT COUNT(*) FROM reward_pending").fetchone()[0]),
        "scored": int(db.execute("SELECT COUNT(*) FROM reward_scores").fetchone()[0]),
        "failed": counts(REWARD_FAILED),
        "alarms": counts(REWARD_ALARM),
        "recent_alarms": [dict(row) for row in recent],
        **means,
    }
