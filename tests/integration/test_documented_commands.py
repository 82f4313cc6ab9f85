"""Every command the README and docs show runs, in its shortest form, and says in one line why
when it cannot: a change to one part cannot silently break a documented command of another.

The commands come from the docs themselves (`documented_commands.py`); each has a smoke run here
or names the test that runs it beside what it needs. Every sub-command's `--help` answers, and the
failures a user can cause (a missing venv, a server that is not there, a config that cannot work,
a wrong path) end in one `decentrl: error:` line and no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from documented_commands import COMMANDS, ROOT, Elsewhere, Smoke, documented_commands

from decentrl.bench import BENCHMARKS
from decentrl.cli import build_parser, main

SMOKE_TIMEOUT_S = 600


def sub_commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def nested_commands() -> dict[str, set[str]]:
    """Commands whose first argument is itself a command: `bench NAME`, `config show`, `launch ray`."""
    nested = {}
    for name, sub in sub_commands(build_parser()).items():
        positionals = [a for a in sub._actions if not a.option_strings and a.choices]
        if positionals:
            nested[name] = set(positionals[0].choices or ())
    return nested


NESTED = nested_commands()


def test_every_documented_command_has_a_test_and_every_entry_is_documented() -> None:
    documented = documented_commands(NESTED)
    assert documented, "no `decentrl ...` command found in the docs' code"
    missing = {key: sorted(files) for key, files in documented.items() if key not in COMMANDS}
    assert not missing, f"documented commands without a smoke entry in documented_commands.py: {missing}"
    assert not set(COMMANDS) - set(documented), (
        f"entries for commands no doc shows: {set(COMMANDS) - set(documented)}"
    )


def test_every_documented_command_exists() -> None:
    known = {*sub_commands(build_parser())} | {
        f"{first} {second}" for first, seconds in NESTED.items() for second in seconds
    }
    assert set(documented_commands(NESTED)) <= known, set(documented_commands(NESTED)) - known


@pytest.mark.parametrize("key", sorted(k for k, v in COMMANDS.items() if isinstance(v, Elsewhere)))
def test_the_test_that_runs_the_command_exists(key: str) -> None:
    entry = COMMANDS[key]
    assert isinstance(entry, Elsewhere)
    path, name = entry.test.split("::")
    assert f"def {name}(" in (ROOT / path).read_text(), f"{key}: {entry.test} does not exist"
    # it runs the command itself: as `decentrl KEY` or through the launcher that starts the role
    source = (ROOT / path).read_text()
    assert key.split()[-1] in source or "run_demo" in source or "short_demo" in source, entry.test


HELP = sorted(sub_commands(build_parser())) + [f"bench {name}" for name in sorted(BENCHMARKS)]


@pytest.mark.parametrize("command", HELP)
def test_help_answers(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command.split(), "--help"])
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


def run_decentrl(argv: list[str], cwd: Path, timeout: float = SMOKE_TIMEOUT_S) -> subprocess.CompletedProcess:
    """`decentrl *argv` in a session of its own: on a timeout, what it started goes with it."""
    command = [sys.executable, "-m", "decentrl", *argv]
    process = subprocess.Popen(
        command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the whole session ended with the command
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from decentrl.config import ModelConfig
    from decentrl.model.tiny import build_tiny, save_model_dir

    return save_model_dir(
        *build_tiny(ModelConfig(hidden_size=64, num_layers=1, num_heads=2)), tmp_path_factory.mktemp("tiny")
    )


def smoke_params() -> list:
    params = []
    for key, entry in sorted(COMMANDS.items()):
        if isinstance(entry, Smoke):
            marks = [pytest.mark.timeout(entry.timeout_s + 60)] + ([pytest.mark.slow] if entry.slow else [])
            params.append(pytest.param(key, marks=marks, id=key))
    return params


@pytest.mark.integration
@pytest.mark.parametrize("key", smoke_params())
def test_documented_command_runs(key: str, tmp_path: Path, tiny_model: Path) -> None:
    entry = COMMANDS[key]
    assert isinstance(entry, Smoke)
    argv = [arg.format(tmp=tmp_path, model=tiny_model) for arg in entry.argv]
    done = run_decentrl(argv, tmp_path, entry.timeout_s)
    output = done.stdout + done.stderr
    assert done.returncode == entry.status, f"decentrl {' '.join(argv)}:\n{output[-4000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    assert entry.expect in output, output[-4000:]
    if key.startswith("bench ") and entry.status == 0:
        assert isinstance(json.loads(done.stdout.strip().splitlines()[-1]), dict)


# A user's mistakes and a machine without what a command needs: (argv, the line's gist).
ONE_LINE_FAILURES = {
    "vllm outside its venv": (
        ["bench", "engines", "--engines", "vllm", "--hidden-size", "64", "--num-heads", "2"],
        ".venv-vllm/bin/decentrl bench engines",
    ),
    "a token budget no context fits": (
        [
            "coordinator",
            "--run-dir",
            "{tmp}/run",
            "--model-dir",
            "{model}",
            "--set",
            "coordinator.max_new_tokens=8000",
        ],
        "none fits the model's context",
    ),
    "not a reward model": (
        ["scorer", "--coordinator", "http://127.0.0.1:9", "--token", "t", "--reward-model", "{tmp}"],
        "is not a model directory",
    ),
    "not a bench coordinator output": (["bench", "swarm", "--service", "{tmp}/none.json"], "--service"),
    "a batch larger than the data": (
        ["train-rm", "--model-dir", "{model}", "--out", "{tmp}/rm", "--pairs", "16"],
        "--batch-size 32 must be between 1 and --pairs (16)",
    ),
    "a worker venv that is not built": (
        ["demo", "--run-dir", "{tmp}/run", "--set", "worker.python='.venv-missing/bin/python'"],
        "worker.python = '.venv-missing/bin/python' is not an executable here",
    ),
    "not a run": (["export", "{tmp}", "--out", "{tmp}/model"], "is not a run directory"),
    "an endpoint without its tokenizer": (["eval", "http://127.0.0.1:9/v1"], "add --model-dir"),
}


@pytest.mark.integration
@pytest.mark.parametrize("case", sorted(ONE_LINE_FAILURES))
def test_a_failure_a_user_can_cause_is_one_line(case: str, tmp_path: Path, tiny_model: Path) -> None:
    argv, gist = ONE_LINE_FAILURES[case]
    done = run_decentrl([arg.format(tmp=tmp_path, model=tiny_model) for arg in argv], tmp_path, timeout=300)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("decentrl: error: ") and gist in last, done.stderr[-3000:]
