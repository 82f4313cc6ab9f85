"""The demo's watch over its roles (`launch/local.py` ExitWatch): a role the run needs that
fails ends the demo with a clear error instead of a wait for rollouts that never come; one
failed worker among several is said once and the run goes on. Roles here are real processes
(small scripts standing in for `python -m decentrl ...`), with real logs."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from decentrl.launch.fork import RoleFailed
from decentrl.launch.local import ExitWatch, Role


class Said:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def say(self, message: str) -> None:
        self.lines.append(message)


def script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def role(tmp_path: Path, name: str, python: str) -> Role:
    return Role(name, ["worker"], tmp_path / "run", python=python)


def ended(*roles: Role) -> None:
    for each in roles:
        each.process.wait(30)


@pytest.fixture
def scripts(tmp_path: Path) -> dict[str, str]:
    return {
        "fails": script(
            tmp_path, "fails", 'echo "loading the engine"; echo "no engine here: vllm missing" >&2; exit 3'
        ),
        "runs": script(tmp_path, "runs", "sleep 30"),
        "done": script(tmp_path, "done", 'echo "the run is complete: exiting"; exit 0'),
    }


def test_the_last_worker_failing_names_it_its_status_its_log_and_its_last_line(tmp_path, scripts):
    watch = ExitWatch(Said(), trainer_samples=False)  # type: ignore[arg-type]
    watch.workers.append(role(tmp_path, "worker-0", scripts["fails"]))
    ended(*watch.workers)
    with pytest.raises(RoleFailed) as failed:
        watch.check()
    message = str(failed.value)
    assert "worker-0 exited (status 3)" in message and "no worker is left" in message
    assert str(tmp_path / "run" / "logs" / "worker-0.log") in message
    assert message.endswith("its last line: no engine here: vllm missing")


def test_one_failed_worker_of_two_is_said_once_and_the_run_goes_on(tmp_path, scripts):
    view = Said()
    watch = ExitWatch(view, trainer_samples=False)  # type: ignore[arg-type]
    failing, running = (
        role(tmp_path, "worker-0", scripts["fails"]),
        role(tmp_path, "worker-1", scripts["runs"]),
    )
    watch.workers += [failing, running]
    ended(failing)
    watch.check()
    watch.check()
    assert view.lines == [f"worker-0 exited (status 3): no engine here: vllm missing; see {failing.log_path}"]
    running.stop(timeout=5)


def test_workers_that_end_with_the_run_and_a_trainer_that_samples_are_no_failure(tmp_path, scripts):
    finished = ExitWatch(Said(), trainer_samples=False)  # type: ignore[arg-type]
    finished.workers.append(role(tmp_path, "worker-0", scripts["done"]))  # exit 0: the run is complete
    colocated = ExitWatch(Said(), trainer_samples=True)  # type: ignore[arg-type]
    colocated.workers.append(role(tmp_path, "worker-1", scripts["fails"]))  # the trainer still samples
    ended(*finished.workers, *colocated.workers)
    finished.check()
    colocated.check()
    assert colocated.view.lines and "worker-1 exited (status 3)" in colocated.view.lines[0]  # type: ignore[attr-defined]


def test_a_needed_role_that_fails_ends_the_run_even_with_workers_left(tmp_path, scripts):
    watch = ExitWatch(Said(), trainer_samples=False)  # type: ignore[arg-type]
    verifier = role(tmp_path, "verifier", scripts["fails"])
    running = role(tmp_path, "worker-0", scripts["runs"])
    watch.needed.append(verifier)
    watch.workers.append(running)
    ended(verifier)
    started = time.monotonic()
    with pytest.raises(
        RoleFailed, match=r"verifier exited \(status 3\) before the trainer finished; the run cannot go on"
    ):
        watch.check()
    assert time.monotonic() - started < 1.0
    running.stop(timeout=5)
