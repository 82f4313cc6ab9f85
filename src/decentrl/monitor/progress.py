"""Live progress view of a run, fed by the coordinator's `/v1/stats`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from rich.console import Console
from rich.live import Live
from rich.table import Table

from decentrl.client import CoordinatorClient

LIVE_SECONDS = 2.0
LINE_SECONDS = 10.0


class Process(Protocol):
    def alive(self) -> bool: ...


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def render(stats: dict, target_version: int) -> Table:
    history = stats.get("history", [])
    last = history[-1]["metrics"] if history else {}
    evals = [h for h in history if "eval_accuracy" in h["metrics"]]
    table = Table(title="decentrl: async RL", show_header=False, min_width=60)
    table.add_column(style="bold")
    table.add_column()
    version = stats.get("latest_version") or 0
    table.add_row("policy version", f"{version} / {target_version}")
    table.add_row("reward (last 200 rollouts)", _fmt(stats["recent"]["reward_mean"]))
    table.add_row("train accuracy (last step)", _fmt(last.get("accuracy")))
    if evals:
        table.add_row(
            "held-out accuracy",
            f"{evals[-1]['metrics']['eval_accuracy']:.3f} @ v{evals[-1]['policy_version']}",
        )
    table.add_row(
        "staleness mean / hist",
        f"{_fmt(stats['staleness']['mean'], '.2f')}  {stats['staleness']['histogram']}",
    )
    table.add_row(
        "rollouts accepted / rejected",
        f"{stats['rollouts_accepted']} / {stats['rollouts_rejected']['total']}",
    )
    table.add_row("groups", "  ".join(f"{k} {v}" for k, v in stats["groups"].items()))
    table.add_row("leases expired", str(stats["leases_expired"]))
    throughput = stats["throughput"]
    table.add_row(
        "throughput",
        f"{throughput['rollouts_per_second']:.1f} rollouts/s  {throughput['tokens_per_second']:.0f} tok/s",
    )
    table.add_row("workers (active)", f"{stats['workers']} ({stats.get('workers_active', '-')})")
    if stats.get("stages"):
        table.add_row("routes (stage holders)", routes(stats["stages"]))
    table.add_row("elapsed", f"{stats['uptime_seconds']:.0f} s")
    if said := trouble(stats):
        table.add_row("run", said)
    return table


def trouble(stats: dict) -> str:
    """What the coordinator says holds the run up (a role not connected, or no progress at all
    with every role there), or ''."""
    run = stats.get("run") or {}
    if run.get("state") == "waiting":
        return "; ".join(entry["message"] for entry in run.get("waiting_for", []))
    if run.get("state") == "stalled":
        return (
            f"stalled: no rollout accepted and no version published for {run['stalled_seconds']:.0f} s "
            "(the roles' logs say why)"
        )
    return ""


def routes(stages: dict) -> str:
    """Each stage holder's share of the routes (leases through it), and the hops that failed."""
    holders = "  ".join(
        f"{h['name']} (stage {h['stage']}{'' if h['live'] else ', gone'}) {h['leases']}"
        for h in stages["holders"]
    )
    failed = sum(stages["hops_failed"].values())
    return f"{holders}  hops failed {failed}" if failed else holders


class ProgressView:
    """A rich live table on a terminal; one plain line every 10 s otherwise (logs, CI)."""

    def __init__(self, enabled: bool, console: Console | None = None):
        self.enabled = enabled
        self.console = console or Console(soft_wrap=True)

    def say(self, message: str) -> None:
        self.console.print(message, highlight=False)

    def follow(
        self,
        client: CoordinatorClient,
        trainer: Process,
        target_version: int,
        check: Callable[[], None] = lambda: None,
    ) -> dict:
        """Refresh until the trainer process exits; returns the last stats. `check()` runs with
        each refresh and may raise (a role the run needs has failed)."""
        stats = client.stats()
        last_line = 0.0
        with (
            Live(render(stats, target_version), console=self.console, refresh_per_second=2, transient=False)
            if self.enabled
            else _NoLive() as live
        ):
            # `/v1/stats` reads every table inside the store's one transaction at a time, so it is
            # asked only as often as it is shown: every 2 s live, with each line every 10 s.
            last_stats = time.monotonic()
            while trainer.alive():
                time.sleep(0.5)
                check()
                now = time.monotonic()
                if self.enabled and now - last_stats >= LIVE_SECONDS:
                    stats, last_stats = client.stats(), now
                    live.update(render(stats, target_version))
                elif not self.enabled and now - last_line > LINE_SECONDS:
                    last_line = now
                    self.say(self.line(client.stats(), target_version))
        stats = client.stats()
        if not self.enabled:
            self.say(self.line(stats, target_version))
        return stats

    @staticmethod
    def line(stats: dict, target_version: int) -> str:
        said = trouble(stats)
        return (
            f"v{stats.get('latest_version') or 0}/{target_version}  reward {_fmt(stats['recent']['reward_mean'])}  "
            f"staleness {_fmt(stats['staleness']['mean'], '.2f')}  accepted {stats['rollouts_accepted']}  "
            f"rejected {stats['rollouts_rejected']['total']}  {stats['throughput']['tokens_per_second']:.0f} tok/s  "
            f"{stats['uptime_seconds']:.0f} s"
            + (f"  routes {routes(stats['stages'])}" if stats.get("stages") else "")
            + (f"  {said}" if said else "")
        )


class _NoLive:
    def __enter__(self) -> _NoLive:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, renderable: object) -> None:  # rich.live.Live's, for a view that shows nothing
        return None
