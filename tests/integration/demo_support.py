"""`decentrl demo` as a user runs it, in a test's directory (shared by the learning, release and
BPE-model tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

LOG_TAIL_CHARS = 2500
"""How much of each role's log a failed or hung demo shows (the test's output is all CI keeps)."""


def role_logs(run_dir: Path) -> str:
    """The end of every log in `run_dir/logs`: what each role was doing when the demo failed."""
    logs = sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").is_dir() else []
    parts = []
    for path in logs:
        text = path.read_text(errors="replace")
        parts.append(f"----- {path.name} (last {min(len(text), LOG_TAIL_CHARS)} of {len(text)} chars)\n")
        parts.append(text[-LOG_TAIL_CHARS:])
    return "".join(parts) or f"(no role logs in {run_dir / 'logs'})"


def run_demo(tmp_path: Path, *overrides: str, timeout: float, config: Path | None = None) -> dict:
    """`decentrl demo` in `tmp_path/run`; returns its summary.json. A demo that fails or runs past
    `timeout` fails the test with its output and the end of each role's log."""
    run_dir = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "decentrl",
        "demo",
        "--run-dir",
        str(run_dir),
        "--set",
        f"sft.cache_dir={str(tmp_path / 'cache')!r}",
        *(["--config", str(config)] if config else []),
    ]
    for override in overrides:
        args += ["--set", override]
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        out = _text(expired.stdout)[-3000:] + _text(expired.stderr)[-3000:]
        raise AssertionError(f"the demo ran past {timeout:.0f} s:\n{out}\n{role_logs(run_dir)}") from None
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + "\n" + role_logs(run_dir)
    assert "summary:" in done.stdout
    assert "dashboard (live, read-only): http://" in done.stdout  # printed while it runs
    assert (run_dir / "learning_curve.png").stat().st_size > 10_000
    summary = json.loads((run_dir / "summary.json").read_text())
    if "export_dir" in summary:  # the demo ends with its export, and says where
        assert f"exported v{summary['num_policy_versions']}: {summary['export_dir']}" in done.stdout
        assert f"`decentrl verify-release {summary['export_dir']} --trainer-key sha256:" in done.stdout
    return summary


def _text(output: str | bytes | None) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""
