"""`decentrl demo` as a user runs it, in a test's directory (shared by the learning, release and
BPE-model tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_demo(tmp_path: Path, *overrides: str, timeout: float, config: Path | None = None) -> dict:
    """`decentrl demo` in `tmp_path/run`; returns its summary.json."""
    args = [
        sys.executable,
        "-m",
        "decentrl",
        "demo",
        "--run-dir",
        str(tmp_path / "run"),
        "--set",
        f"sft.cache_dir={str(tmp_path / 'cache')!r}",
        *(["--config", str(config)] if config else []),
    ]
    for override in overrides:
        args += ["--set", override]
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "summary:" in done.stdout
    assert "dashboard (live, read-only): http://" in done.stdout  # printed while it runs
    assert (tmp_path / "run" / "learning_curve.png").stat().st_size > 10_000
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    if "export_dir" in summary:  # the demo ends with its export, and says where
        assert f"exported v{summary['num_policy_versions']}: {summary['export_dir']}" in done.stdout
        assert f"`decentrl verify-release {summary['export_dir']} --trainer-key sha256:" in done.stdout
    return summary
