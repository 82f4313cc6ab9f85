"""The demo's progress line (`monitor/progress.py`): what the coordinator says holds a run up is
shown where the user looks, not only in the coordinator's log."""

from __future__ import annotations

from decentrl.monitor.progress import ProgressView, render, trouble


def stats(run: dict) -> dict:
    return {
        "latest_version": 0,
        "recent": {"reward_mean": None},
        "staleness": {"mean": None, "histogram": {}},
        "rollouts_accepted": 0,
        "rollouts_rejected": {"total": 0, "by_reason": {}},
        "groups": {},
        "leases_expired": 0,
        "throughput": {"rollouts_per_second": 0.0, "tokens_per_second": 0.0},
        "workers": 1,
        "uptime_seconds": 412.4,
        "run": run,
    }


WAITING = {
    "state": "waiting",
    "waiting_for": [{"role": "verifier", "message": "waiting for a verifier: 3 verification jobs pending"}],
    "stalled_since": None,
    "stalled_seconds": None,
}


def test_a_running_run_says_nothing_more() -> None:
    running = stats({"state": "running", "waiting_for": [], "stalled_since": None, "stalled_seconds": None})
    assert trouble(running) == ""
    assert (
        ProgressView.line(running, 3) == "v0/3  reward -  staleness -  accepted 0  rejected 0  0 tok/s  412 s"
    )


def test_a_run_waiting_for_a_role_says_which_and_a_stalled_one_for_how_long() -> None:
    assert ProgressView.line(stats(WAITING), 3).endswith(
        "412 s  waiting for a verifier: 3 verification jobs pending"
    )
    stalled = stats(
        {"state": "stalled", "waiting_for": [], "stalled_since": 1000.0, "stalled_seconds": 307.6}
    )
    assert trouble(stalled) == (
        "stalled: no rollout accepted and no version published for 308 s (the roles' logs say why)"
    )
    assert ProgressView.line(stalled, 3).endswith(trouble(stalled))
    rows = render(stalled, 3).columns[1]._cells  # the live table shows it too
    assert rows[-1] == trouble(stalled)
