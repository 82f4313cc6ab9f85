"""`decentrl bench NAME` loads its harness from the checkout's `benchmarks/`, and says in one line
what to do where there is none."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from decentrl import bench
from decentrl.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_every_benchmark_has_a_harness_in_the_checkout() -> None:
    assert set(bench.MODULES) == set(bench.BENCHMARKS)
    for name, module in bench.MODULES.items():
        assert bench.harness_folder(module, [ROOT / "benchmarks"]) == ROOT / "benchmarks", name


def test_the_installed_package_holds_no_harness() -> None:
    assert not (ROOT / "src" / "decentrl" / "bench").exists()
    assert not list((ROOT / "src" / "decentrl").rglob("benchmarks/__init__.py"))


def test_a_folder_without_the_harness_is_passed_over(tmp_path: Path) -> None:
    unrelated = tmp_path / "benchmarks"  # someone else's `benchmarks/` in the current directory
    unrelated.mkdir()
    (unrelated / "__init__.py").write_text("")
    renamed = tmp_path / "harnesses"
    (renamed / "swarm").mkdir(parents=True)
    (renamed / "swarm" / "main.py").write_text("")
    places = [unrelated, renamed, ROOT / "benchmarks"]
    assert bench.harness_folder(bench.MODULES["swarm"], places) == ROOT / "benchmarks"


def test_the_environment_variable_is_looked_at_first(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(bench.ENVIRONMENT, str(tmp_path / "benchmarks"))
    assert bench.candidates()[0] == tmp_path / "benchmarks"
    assert ROOT / "benchmarks" in bench.candidates()


def test_without_a_checkout_the_command_says_so_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench, "candidates", lambda: [tmp_path / "benchmarks"])
    assert main(["bench", "swarm", "--workers", "10"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("decentrl: error: `decentrl bench swarm` needs the harnesses in benchmarks/")
    assert str(tmp_path / "benchmarks") in line
    assert "run it from a clone of the repository" in line and bench.ENVIRONMENT in line


def test_help_answers_from_the_checkout_outside_it(tmp_path: Path) -> None:
    """The editable install finds `benchmarks/` beside its `src/`, whatever the current directory."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", bench.ENVIRONMENT)}
    done = subprocess.run(
        [sys.executable, "-m", "decentrl", "bench", "swarm", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout and "--workers" in done.stdout
