"""The sandbox attack suite: one test per attack, each contained or scored 0, with the host
(this process's children, open files, memory, the planted files, the disk, a bystander process of the
sandbox's uid, a loopback listener) measured unchanged. The programs and the judgement live in
`benchmarks.sandbox.attacks`, shared with `decentrl bench sandbox`.
"""

from __future__ import annotations

import pytest

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
    outcome = run_attack(ATTACKS_BY_NAME[name], config)
    assert outcome.contained, f"{name}: {outcome.failures} ({outcome.summary})"
    assert outcome.wall_s < config.wall_seconds + 2.0
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
