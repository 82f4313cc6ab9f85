"""`decentrl bench wan` with a tiny fleet for a few seconds per mode: two workers behind lossy
50 ms links, one of them killed and restarted, decentrl and the synchronous barrier. Its figures
must come from what ran: versions trained, bytes through the proxies, the barrier's rollouts all
of the current version, the churn applied."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.slow  # about a minute: two runs of ~8 s each, their roles' start and stop
def test_a_tiny_wan_fleet_runs_both_modes_and_its_figures_add_up(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "decentrl", "bench", "wan", "--out", str(tmp_path / "wan"),
        "--set", "sft.steps=20", "--set", f"sft.cache_dir={str(tmp_path / 'cache')!r}",
        "--set", "trainer.eval_size=16", "--set", "trainer.groups_per_step=4",
        "--set", "coordinator.group_size=4", "--set", "coordinator.max_pending_groups=12",
        "--modes", "decentrl", "barrier", "--rtt-ms", "50", "--workers", "2", "--budget-s", "8", "--censor-s", "0",
        "--threshold", "1.01", "--eval-every", "2", "--churn-per-minute", "15", "--downtime-s", "1",
        "--drop-rate", "0.01", "--stall-rate", "0.01", "--stall-s", "0.2",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert [(row["mode"], row["rtt_ms"]) for row in summary["rows"]] == [
        ("decentrl", 50.0),
        ("barrier", 50.0),
    ]
    assert Path(summary["plot"]).stat().st_size > 5_000
    runs = {run["mode"]: run for run in json.loads((tmp_path / "wan" / "wan.json").read_text())["runs"]}
    for mode, run in runs.items():
        assert run["versions"] >= 1 and run["trained_rollouts_per_second"] > 0, (mode, run)
        assert run["time_to_threshold_s"] is None and run["reached"] is None  # 1.01 is never reached
        assert run["traffic"]["coordinator_bytes"] > 0 and run["bytes_per_version"] > 0
        assert run["cpu_shares"] in ("cgroup-v1", "cgroup-v2", "stop-continue")
        assert run["reach_90"]["versions"] >= 1
        idle = run["trainer_idle_share"]  # None with fewer than two versions (a loaded machine)
        assert idle is None or 0.0 <= idle <= 1.0
    # the barrier trains only rollouts of the version it trains at
    assert set(runs["barrier"]["staleness_histogram"]) == {"0"}
    # a kill every 2 s on average over 8 s: the schedule killed and restarted someone
    cell = json.loads((tmp_path / "wan" / "decentrl-rtt50-seed0" / "cell.json").read_text())
    assert any("kill" in event for event in cell["churn"]) and any(
        "start" in event for event in cell["churn"]
    )
    assert max(worker["lives"] for worker in cell["workers"]) >= 2
