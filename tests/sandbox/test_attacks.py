"""The sandbox attack suite: one test per attack, each contained or scored 0, with the host
(this process's children, open files, memory, the planted files, the disk, a bystander process of the
sandbox's uid, a loopback listener) measured unchanged. The programs and the judgement live in
`benchmarks.sandbox.attacks`, shared with `decentrl bench sandbox`.
"""

from __future__ import annotations

import pytest

from benchmarks.sandbox import attack_sources, attacks
from benchmarks.sandbox.attacks import ATTACKS, ATTACKS_BY_NAME, attack_config, run_attack
from decentrl.config import SandboxConfig
from decentrl.sandbox import bubblewrap

REQUIRED_ATTACKS = [
    "fork_bomb",
    "memory_bomb",
    "infinite_loop",
    "disk_fill",
    "network",
    "read_host_files",
    "write_outside_workdir",
    "signal_parent",
    "os_exit_zero",
    "always_equal",
]


@pytest.fixture(scope="module")
def config() -> SandboxConfig:
    return attack_config()


@pytest.mark.parametrize("name", [attack.name for attack in ATTACKS])
def test_attack_is_contained(name: str, config: SandboxConfig) -> None:
    attack = ATTACKS_BY_NAME[name]
    outcome = run_attack(attack, config)
    assert outcome.contained, f"{name}: {outcome.failures} ({outcome.summary})"
    assert outcome.wall_s < attack.run_config(config).wall_seconds + 2.0
    if name == "fork_bomb":  # it really reached the limit: the bound, not a failure to start, stopped it
        assert config.processes - 4 <= outcome.peak_processes <= config.processes + 1


def test_suite_covers_every_required_attack() -> None:
    assert set(REQUIRED_ATTACKS) <= set(ATTACKS_BY_NAME)


def test_the_judge_sees_an_escape(config: SandboxConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a tautology: with the network namespace shared, the same attack is reported escaped."""
    isolation = bubblewrap._isolation_args
    monkeypatch.setattr(bubblewrap, "_isolation_args", lambda c: [*isolation(c), "--share-net"])
    outcome = run_attack(ATTACKS_BY_NAME["network"], config)
    assert not outcome.contained
    assert "a connection reached the host's loopback listener" in outcome.failures


def test_the_judge_sees_an_open_kernel_surface(
    config: SandboxConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the seccomp deny-list, ptrace and friends answer with something other than EPERM."""
    monkeypatch.setattr(bubblewrap, "SECCOMP_FILTER", None)
    outcome = run_attack(ATTACKS_BY_NAME["kernel_surface"], config)
    assert not outcome.contained
    assert any(failure.startswith("allowed ptrace") for failure in outcome.failures)


def test_a_slow_memory_bomb_still_reports_its_refusal(config: SandboxConfig) -> None:
    """Under load the bomb's allocations take longer than the suite's short wall clock (here made
    shorter than they ever take); it ends by itself, so it runs to its report and is judged on it."""
    hurried = config.model_copy(update={"wall_seconds": 0.05})
    outcome = run_attack(ATTACKS_BY_NAME["memory_bomb"], hurried)
    assert outcome.contained, f"{outcome.failures} ({outcome.summary})"
    assert outcome.summary == "exit 0, killed None"


def test_an_attack_killed_before_its_report_is_not_contained(
    config: SandboxConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No report, no evidence: an attack whose checks look for lines it prints is not judged
    contained on an empty output when the clock stopped it. The program first sleeps past the clock,
    so it never reports however fast the machine (a bare 0.05 s clock raced its quick report)."""
    monkeypatch.setattr(attacks, "FINISH_WALL_SECONDS", 0.5)
    monkeypatch.setitem(
        attack_sources.SOURCES,
        "read_host_files",
        "import time\ntime.sleep(30)\n" + attack_sources.READ_HOST_FILES,
    )
    hurried = config.model_copy(update={"wall_seconds": 0.5})
    outcome = run_attack(ATTACKS_BY_NAME["read_host_files"], hurried)
    assert not outcome.contained
    assert outcome.failures == ["killed by the wall clock at 0.5 s before it reported"]
