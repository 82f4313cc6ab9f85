"""`decentrl bench coordinator` against a real coordinator process, briefly: it measures what it says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.profiling import summarise


def test_profile_summary_counts_self_and_inclusive_time() -> None:
    collapsed = "\n".join(
        [
            "serve (decentrl/coordinator/server.py:90);submit (decentrl/coordinator/ingest.py:230);"
            "dumps (json/__init__.py:231) 3",
            "serve (decentrl/coordinator/server.py:90);lease (decentrl/coordinator/leasing.py:120) 1",
        ]
    )
    summary = summarise(collapsed)
    assert summary["samples"] == 4
    assert summary["self"][0] == ["json/__init__.py:dumps", 0.75]
    inclusive = dict(map(tuple, summary["decentrl_inclusive"]))
    assert inclusive == {
        "decentrl/coordinator/server.py:serve": 1.0,
        "decentrl/coordinator/ingest.py:submit": 0.75,
        "decentrl/coordinator/leasing.py:lease": 0.25,
    }


@pytest.mark.integration
@pytest.mark.slow  # about 40 s on two quiet cores: a coordinator per length, four phases
def test_bench_coordinator_reports_accepted_rollouts_latency_and_cost(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "decentrl.cli",
        "bench",
        "coordinator",
        "--workers",
        "4",
        "--processes",
        "1",
        "--group-size",
        "2",
        "--tokens",
        "50",
        "200",
        "--seconds",
        "3",
        "--warmup",
        "1",
        "--phase-seconds",
        "2",
        "--root",
        str(tmp_path),
    ]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    result = json.loads(finished.stdout.strip().splitlines()[-1])
    assert [length["rollout_tokens"] for length in result["lengths"]] == [50, 200]
    for length in result["lengths"]:
        assert length["errors"] == 0, length["first_errors"]
        assert length["accepted_rollouts_per_second"] > 0
        assert {"lease", "submit", "weights_latest"} <= set(length["latency"])
        assert length["cpu_seconds_per_accepted_rollout"] > 0
        assert length["rollouts_stored"] > 0 and length["store_bytes_per_rollout"] > 0
        assert length["cpu_seconds_per_poll"] > 0 and length["cpu_seconds_per_chunk"] > 0
    # A 200-token rollout takes more room than a 50-token one.
    assert result["lengths"][1]["store_bytes_per_rollout"] > result["lengths"][0]["store_bytes_per_rollout"]
    assert result["service_cpu_seconds"]["weights_chunk"] > 0
