"""`decentrl demo` as a user runs it, in a test's directory (shared by the learning, release and
BPE-model tests)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from decentrl.proctree import descendants, kill_tree

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
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stacks = python_stacks(process.pid)  # where each role is stuck, before they are killed
            kill_tree(process.pid)
            stdout, stderr = process.communicate()
            raise AssertionError(
                f"the demo ran past {timeout:.0f} s:\n{stdout[-3000:]}{stderr[-3000:]}\n"
                f"{role_logs(run_dir)}\n{stacks}"
            ) from None
    assert process.returncode == 0, stdout[-3000:] + stderr[-3000:] + "\n" + role_logs(run_dir)
    assert "summary:" in stdout
    assert "dashboard (live, read-only): http://" in stdout  # printed while it runs
    assert (run_dir / "learning_curve.png").stat().st_size > 10_000
    summary = json.loads((run_dir / "summary.json").read_text())
    if "export_dir" in summary:  # the demo ends with its export, and says where
        assert f"exported v{summary['num_policy_versions']}: {summary['export_dir']}" in stdout
        assert f"`decentrl verify-release {summary['export_dir']} --trainer-key sha256:" in stdout
    return summary


def python_stacks(pid: int) -> str:
    """Every thread's Python stack in `pid` and the processes below it (`py-spy dump`, in the
    bench extra), or why not."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).is_file():
        return "(no py-spy to show the roles' stacks)"
    parts = []
    for each in descendants(pid):
        try:
            dump = subprocess.run(
                [py_spy, "dump", "--pid", str(each)], capture_output=True, text=True, timeout=60
            )
            parts.append(f"----- py-spy dump --pid {each}\n{dump.stdout[-4000:]}{dump.stderr[-500:]}")
        except subprocess.TimeoutExpired:
            parts.append(f"----- py-spy dump --pid {each}: no answer in 60 s")
    return "\n".join(parts)
