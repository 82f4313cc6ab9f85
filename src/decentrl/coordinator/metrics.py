"""Run statistics: JSON for `/v1/stats` (live view, final summary) and Prometheus text for `/metrics`.

Every number is computed from the store, so counters survive a coordinator restart.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import Counter
from collections.abc import Callable

from decentrl.coordinator import env_servers
from decentrl.coordinator.context import Context
from decentrl.coordinator.db.store import (
    GROUP_EXPIRED,
    GROUP_FILTERED,
    GROUP_STATES,
    LEASE_EXPIRED,
    PROMPT_SKIPPED,
    REJECTED,
    STAGE_HOP_FAILED,
    latest_version,
)
from decentrl.coordinator.pipeline import scoring
from decentrl.coordinator.pipeline.batching import metrics_history
from decentrl.coordinator.stage_routing import HOLDER_TTL_SECONDS
from decentrl.coordinator.trust import verification
from decentrl.dbapi import Connection

RECENT_ROLLOUTS = 200
THROUGHPUT_WINDOW_SECONDS = 30.0
ACTIVE_WORKER_SECONDS = 60.0


def _scalar(db: Connection, query: str, *args: object) -> float:
    value = db.execute(query, args).fetchone()[0]
    return 0 if value is None else value


def _rewards(db: Connection) -> dict:
    rows = db.execute(
        "SELECT reward FROM rollouts WHERE rollout_id NOT IN (SELECT rollout_id FROM reward_pending)"
        " ORDER BY seq DESC LIMIT ?",
        (RECENT_ROLLOUTS,),
    ).fetchall()
    rewards = [row["reward"] for row in rows]
    if not rewards:
        return {"count": 0, "reward_mean": None, "accuracy": None}
    accuracy = sum(1 for reward in rewards if reward == 1.0) / len(rewards)
    return {"count": len(rewards), "reward_mean": sum(rewards) / len(rewards), "accuracy": accuracy}


def _staleness(db: Connection) -> dict:
    rows = db.execute(
        "SELECT staleness, COUNT(*) AS n FROM rollouts WHERE staleness IS NOT NULL GROUP BY staleness"
    )
    histogram = {int(row["staleness"]): int(row["n"]) for row in rows}
    total = sum(histogram.values())
    mean = sum(value * count for value, count in histogram.items()) / total if total else None
    return {"mean": mean, "histogram": histogram}


def _throughput(db: Connection, now: float) -> dict:
    since = now - THROUGHPUT_WINDOW_SECONDS
    row = db.execute(
        "SELECT COUNT(*), SUM(num_model_tokens) FROM rollouts WHERE accepted >= ?", (since,)
    ).fetchone()
    return {
        "window_seconds": THROUGHPUT_WINDOW_SECONDS,
        "rollouts_per_second": row[0] / THROUGHPUT_WINDOW_SECONDS,
        "tokens_per_second": (row[1] or 0) / THROUGHPUT_WINDOW_SECONDS,
    }


def run_state(context: Context) -> dict:
    """running; waiting (for a role that is not connected: `waiting_for` names it and the command
    that starts it); stalled (no progress for a while with every role there); or complete. With
    which trusted roles are connected (`coordinator/role_watch.py`)."""
    roles = context.roles
    return {
        "state": roles.state(),
        "waiting_for": roles.waiting,
        "connected": roles.connected(),
        "stalled_since": roles.stalled_since,
        "stalled_seconds": None if roles.stalled_since is None else context.clock() - roles.stalled_since,
        "complete": roles.complete,
    }


def _stages(db: Connection, context: Context, now: float) -> dict | None:
    """A staged run's routes: per holder, the leases and rollouts routed through it; failed hops."""
    if context.stage_map is None:
        return None
    holders = db.execute(
        "SELECT w.name, h.stage, h.version, h.seen,"
        " (SELECT COUNT(*) FROM lease_routes r WHERE r.worker_id = h.worker_id) AS leases,"
        " (SELECT COUNT(*) FROM rollouts o JOIN lease_routes r ON r.lease_id = o.lease_id"
        "  WHERE r.worker_id = h.worker_id) AS rollouts"
        " FROM stage_holders h JOIN workers w ON w.worker_id = h.worker_id ORDER BY h.stage, w.name"
    ).fetchall()
    failed = Counter(
        row["reason"].split(":", 1)[0]
        for row in db.execute("SELECT reason FROM events WHERE kind = ?", (STAGE_HOP_FAILED,))
    )
    return {
        "map": context.stage_map.describe(),
        "holders": [
            {
                "name": row["name"],
                "stage": row["stage"],
                "version": row["version"],
                "live": row["seen"] > now - HOLDER_TTL_SECONDS,
                "leases": row["leases"],
                "rollouts": row["rollouts"],
            }
            for row in holders
        ],
        "hops_failed": dict(failed),
    }


def stats(context: Context, service: dict | None = None) -> dict:
    """The run's figures; `service`: the HTTP layer's counters (`budget.KnownTokens.stats`)."""
    now = context.clock()
    with context.store.transaction() as db:
        rejected = Counter(
            {
                row["reason"]: row["n"]
                for row in db.execute(
                    "SELECT reason, COUNT(*) AS n FROM events WHERE kind = ? GROUP BY reason", (REJECTED,)
                )
            }
        )
        groups = dict.fromkeys(GROUP_STATES, 0)
        groups.update(
            {
                row["state"]: row["n"]
                for row in db.execute("SELECT state, COUNT(*) AS n FROM tasks GROUP BY state")
            }
        )
        return {
            "run": run_state(context),
            "latest_version": latest_version(db),
            "rollouts_accepted": int(_scalar(db, "SELECT COUNT(*) FROM rollouts")),
            "tokens_accepted": int(_scalar(db, "SELECT SUM(num_model_tokens) FROM rollouts")),
            "rollouts_rejected": {"total": sum(rejected.values()), "by_reason": dict(rejected)},
            "groups": groups,
            "leases_expired": int(_scalar(db, "SELECT COUNT(*) FROM events WHERE kind = ?", LEASE_EXPIRED)),
            "groups_expired": int(_scalar(db, "SELECT COUNT(*) FROM events WHERE kind = ?", GROUP_EXPIRED)),
            "groups_filtered": int(_scalar(db, "SELECT COUNT(*) FROM events WHERE kind = ?", GROUP_FILTERED)),
            "prompts_skipped": int(_scalar(db, "SELECT COUNT(*) FROM events WHERE kind = ?", PROMPT_SKIPPED)),
            "workers": int(_scalar(db, "SELECT COUNT(*) FROM workers")),
            "workers_active": int(
                _scalar(db, "SELECT COUNT(*) FROM workers WHERE last_seen >= ?", now - ACTIVE_WORKER_SECONDS)
            ),
            "recent": _rewards(db),
            "stages": _stages(db, context, now),
            "envd": env_servers.summary(db, now) if context.run.task.served else None,
            "staleness": _staleness(db),
            "throughput": _throughput(db, now),
            "uptime_seconds": now - context.started,
            "history": [step.model_dump(exclude={"rollout_logprobs"}) for step in metrics_history(db)],
            "trust": verification.summary(db, context.tolerances),
            "reward": scoring.summary(db),
            "service": service or {},
        }


class CachedStats:
    """`stats` computed at most once per `seconds` for the unauthenticated `/metrics`: a scrape may
    come from anyone, and `stats` reads every table, so anyone could otherwise keep the store busy.
    Concurrent callers wait for the one computation instead of starting their own."""

    def __init__(
        self, context: Context, service: Callable[[], dict] | None = None, seconds: float = 5.0
    ) -> None:
        self.context = context
        self.service = service or dict
        self.seconds = seconds
        self._lock = threading.Lock()
        self._computed = -seconds
        self._value: dict = {}

    def get(self) -> dict:
        with self._lock:
            if time.monotonic() - self._computed >= self.seconds:
                self._value, self._computed = stats(self.context, self.service()), time.monotonic()
            return self._value


def _metric_name(text: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", text)


def _number(value: float | None) -> str:
    """Prometheus spells the special values NaN, +Inf and -Inf."""
    if value is None or math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Exposition:
    """Builds the Prometheus text exposition format, one HELP/TYPE header per metric family."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str, samples: dict[str, float] | float | None) -> None:
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        if isinstance(samples, dict):
            for labels, value in samples.items():
                self.lines.append(f"{name}{{{labels}}} {_number(value)}")
        else:
            self.lines.append(f"{name} {_number(samples)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32)


def _staleness_histogram(out: _Exposition, histogram: dict) -> None:
    """Staleness of trained rollouts as a Prometheus histogram (cumulative `le` buckets)."""
    counts = {int(value): count for value, count in histogram.items()}
    samples = {
        f'le="{bound}"': sum(n for v, n in counts.items() if v <= bound) for bound in STALENESS_BUCKETS
    }
    total_count = sum(counts.values())
    samples['le="+Inf"'] = total_count
    out.lines += [
        "# HELP decentrl_rollout_staleness Versions between sampling and training, per trained rollout.",
        "# TYPE decentrl_rollout_staleness histogram",
    ]
    out.lines += [
        f"decentrl_rollout_staleness_bucket{{{labels}}} {_number(n)}" for labels, n in samples.items()
    ]
    total = sum(v * n for v, n in counts.items())
    out.lines += [
        f"decentrl_rollout_staleness_sum {_number(total)}",
        f"decentrl_rollout_staleness_count {_number(total_count)}",
    ]


def _reward_families(out: _Exposition, reward: dict) -> None:
    out.family(
        "decentrl_reward_pending", "gauge", "Accepted rollouts waiting for their reward.", reward["pending"]
    )
    out.family("decentrl_rewards_scored_total", "counter", "Rollouts scored.", reward["scored"])
    failed = {f'kind="{_label(kind)}"': n for kind, n in reward["failed"].items()}
    out.family("decentrl_reward_failed_total", "counter", "Scoring calls that failed, by kind.", failed)
    alarms = {f'alarm="{_label(alarm)}"': n for alarm, n in reward["alarms"].items()}
    out.family("decentrl_reward_alarms_total", "counter", "Reward-hacking alarms, by monitor.", alarms)
    terms = {f'term="{_label(term)}"': value for term, value in reward["terms"].items()}
    out.family("decentrl_reward_term", "gauge", "Mean score of each rubric term (recent rollouts).", terms)
    diagnostics = {f'name="{_label(name)}"': value for name, value in reward["diagnostics"].items()}
    out.family(
        "decentrl_reward_diagnostic",
        "gauge",
        "Mean of each reward diagnostic (recent rollouts).",
        diagnostics,
    )


def _envd_families(out: _Exposition, envd: dict) -> None:
    failures = {f'reason="{_label(reason)}"': n for reason, n in envd["failures"].items()}
    out.family(
        "decentrl_env_failures_total",
        "counter",
        "Served episodes ended by an environment failure, by reason.",
        failures,
    )
    episodes = {f'state="{_label(state)}"': n for state, n in envd["episodes"].items()}
    out.family("decentrl_env_episodes", "gauge", "Served episodes granted, by state.", episodes)
    out.family(
        "decentrl_env_retries_total", "counter", "Served episodes granted as retries.", envd["retries"]
    )
    out.family(
        "decentrl_env_tasks_given_up_total",
        "counter",
        "Served tasks given up after task.max_env_failures failed episodes.",
        envd["tasks_given_up"],
    )
    live = sum(1 for server in envd["servers"] if server["live"])
    out.family("decentrl_env_servers_live", "gauge", "Env servers heard from lately.", live)


def prometheus(snapshot: dict) -> str:
    """Render a `stats()` snapshot as Prometheus text (https://prometheus.io/docs/instrumenting/exposition_formats/)."""
    out = _Exposition()
    out.family(
        "decentrl_rollouts_accepted_total", "counter", "Rollouts accepted.", snapshot["rollouts_accepted"]
    )
    by_reason = snapshot["rollouts_rejected"]["by_reason"]
    rejected = {f'reason="{_label(reason)}"': count for reason, count in by_reason.items()}
    out.family("decentrl_rollouts_rejected_total", "counter", "Rejected submissions by reason.", rejected)
    out.family(
        "decentrl_leases_expired_total",
        "counter",
        "Leases that passed their deadline.",
        snapshot["leases_expired"],
    )
    out.family(
        "decentrl_groups_expired_total", "counter", "Groups expired as too stale.", snapshot["groups_expired"]
    )
    out.family(
        "decentrl_prompts_skipped_total",
        "counter",
        "Train prompts skipped: no room for the token budget in the model's context.",
        snapshot["prompts_skipped"],
    )
    out.family(
        "decentrl_tokens_accepted_total", "counter", "Model tokens accepted.", snapshot["tokens_accepted"]
    )
    out.family(
        "decentrl_policy_version", "gauge", "Latest published policy version.", snapshot["latest_version"]
    )
    trust = snapshot["trust"]
    out.family("decentrl_workers_quarantined", "gauge", "Workers quarantined.", trust["workers_quarantined"])
    jobs = {f'state="{state}"': count for state, count in trust["jobs"].items()}
    out.family("decentrl_verify_jobs", "gauge", "Verification jobs by state.", jobs)
    groups = {f'state="{state}"': count for state, count in snapshot["groups"].items()}
    out.family("decentrl_groups", "gauge", "Groups by state.", groups)
    out.family("decentrl_workers", "gauge", "Registered workers.", snapshot["workers"])
    out.family(
        "decentrl_workers_active", "gauge", "Workers seen in the last minute.", snapshot["workers_active"]
    )
    out.family(
        "decentrl_groups_filtered_total",
        "counter",
        "Groups skipped by dynamic sampling (all rewards equal).",
        snapshot["groups_filtered"],
    )
    out.family(
        "decentrl_mean_staleness",
        "gauge",
        "Mean staleness of trained rollouts.",
        snapshot["staleness"]["mean"],
    )
    _staleness_histogram(out, snapshot["staleness"]["histogram"])
    _reward_families(out, snapshot["reward"])
    if snapshot.get("envd") is not None:
        _envd_families(out, snapshot["envd"])
    service = snapshot.get("service", {})
    out.family(
        "decentrl_client_disconnects_total",
        "counter",
        "Clients that disconnected before their request was read.",
        service.get("client_disconnects", 0),
    )
    refused = {
        f'reason="{reason}"': service.get(f"refused_{reason}", 0)
        for reason in ("busy", "per_client", "failed_auth")
    }
    out.family(
        "decentrl_requests_refused_total", "counter", "Requests refused by the request budget.", refused
    )
    if snapshot["history"]:
        latest = snapshot["history"][-1]
        for name, value in sorted(latest["metrics"].items()):
            metric = f"decentrl_trainer_{_metric_name(name)}"
            out.family(metric, "gauge", f"Trainer metric {name} at its latest step.", value)
    return out.text()
