"""The README's "Running across machines" block, run as written: each line in a directory of its
own as if on its own machine, a shell expanding it, only HOST, the port and the two tokens filled
in as a user would. The run must end by itself and reach the held-out accuracy the README states."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"
ROLES = ("warmstart", "coordinator", "trainer", "verifier", "worker")


def by_hand_section() -> str:
    return README.read_text().split("## Running across machines", 1)[1].split("\n## ", 1)[0]


def readme_commands() -> dict[str, str]:
    """The block's command lines by role, comments cut."""
    block = by_hand_section().split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line.split(" #", 1)[0].strip() for line in block.splitlines()]
    commands = {line.split()[1]: line for line in lines if line}
    assert tuple(commands) == ROLES, commands
    return commands


def readme_accuracy() -> tuple[float, float]:
    """What the README promises: held-out accuracy from about A to at least B."""
    text = " ".join(by_hand_section().split())  # the README's lines wrap anywhere
    found = re.search(r"held-out accuracy from about (\d\.\d+) to at least (\d\.\d+)", text)
    assert found, "the by-hand section states no held-out accuracy"
    return float(found[1]), float(found[2])


def test_the_readme_states_every_role_and_its_result() -> None:
    """The block parses into the five commands and one promise."""
    commands = readme_commands()
    assert "--config demo" in commands["coordinator"] and "--config demo" in commands["trainer"]
    before, after = readme_accuracy()
    assert 0 <= before < after <= 1


class Machine:
    """One line of the block, in its own directory (its own home for `~`), through bash."""

    def __init__(self, root: Path, role: str, command: str, env: dict[str, str]) -> None:
        self.dir = root / f"{role}-machine"
        (self.dir / "home").mkdir(parents=True)
        self.log_path = self.dir / "output.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            ["bash", "-c", command],
            cwd=self.dir,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**env, "HOME": str(self.dir / "home")},
            start_new_session=True,
        )

    def alive(self) -> bool:
        return self.process.poll() is None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.alive():
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


def wait_for(condition, what: str, machines: list[Machine], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {m.dir.name}\n{m.output()[-3000:]}" for m in machines)
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{logs}")
        time.sleep(1.0)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow  # about 100 s: a 2,000-step warm start and 100 versions (CI runs test_by_hand.py)
@pytest.mark.timeout(2700)
def test_the_readmes_run_by_hand_learns_what_it_says(tmp_path: Path) -> None:
    commands = readme_commands()
    before, at_least = readme_accuracy()
    # a fresh machine's cache (shared by the roles: one disk here), the checkout's `decentrl` on PATH
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    port = str(free_port())
    fill = {"HOST": "127.0.0.1", "8760": port}
    machines: list[Machine] = []
    started = time.monotonic()
    try:
        warm = Machine(tmp_path, "warmstart", commands["warmstart"], env)
        machines.append(warm)
        wait_for(lambda: not warm.alive(), "the warm start", machines, timeout=1200)
        assert warm.process.returncode == 0, warm.output()[-3000:]
        model_dir = Path(warm.output().strip().splitlines()[-1])
        assert (model_dir / "config.json").is_file(), warm.output()[-2000:]

        coordinator = Machine(tmp_path, "coordinator", with_filled(commands["coordinator"], fill), env)
        machines.append(coordinator)
        run_dir = coordinator.dir / "runs" / "r1"
        wait_for(lambda: (run_dir / "coordinator.json").is_file(), "the coordinator", machines, timeout=120)
        tokens = json.loads((run_dir / "tokens.json").read_text())
        fill |= {"TRAINER_TOKEN": tokens["trainer_token"], "ENROLL_TOKEN": tokens["enroll_token"]}
        for role in ("trainer", "verifier", "worker"):
            machines.append(Machine(tmp_path, role, with_filled(commands[role], fill), env))
        trainer, worker = machines[2], machines[4]
        wait_for(lambda: not trainer.alive() and not worker.alive(), "the run's end", machines, timeout=1500)
        assert trainer.process.returncode == 0, trainer.output()[-3000:]
        assert worker.process.returncode == 0, worker.output()[-3000:]
        assert "the run is complete" in worker.output()
        log = run_dir / "coordinator.log"
        wait_for(
            lambda: "held-out accuracy (first -> last eval)" in log.read_text(), "the summary", machines, 60
        )
        said = log.read_text()
    finally:
        for machine in reversed(machines):
            machine.stop()
    # version 0 is the trainer's first evaluation: the model before any update
    found = re.search(r"held-out accuracy \(first -> last eval\) (\S+) \(v0\) -> (\S+) \(v(\d+)\),", said)
    assert found, said[-2000:]
    first, last, version = float(found[1]), float(found[2]), int(found[3])
    elapsed = time.monotonic() - started
    print(
        f"README by hand: held-out {first:.3f} -> {last:.3f} at v{version} in {elapsed:.0f} s (README: about {before} to at least {at_least})"
    )
    assert version == int(re.search(r"trainer\.num_steps=(\d+)", commands["trainer"])[1])
    assert abs(first - before) <= 0.05, (first, before)
    assert last >= at_least, (last, at_least)


def with_filled(command: str, fill: dict[str, str]) -> str:
    for placeholder, value in fill.items():
        command = re.sub(rf"\b{placeholder}\b", value, command)
    return command
