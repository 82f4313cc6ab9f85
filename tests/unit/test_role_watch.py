"""Which trusted roles count as connected: a trainer busy with a long version is not reported
missing, a verifier or scorer that stopped polling is, and a role never seen is at once."""

from __future__ import annotations

from pathlib import Path

from decentrl.coordinator.role_watch import Role, RoleWatch


def test_a_trainer_silent_while_it_trains_stays_connected_and_a_silent_verifier_does_not(
    tmp_path: Path,
) -> None:
    now = [1000.0]
    watch = RoleWatch(lambda: now[0], tmp_path)
    assert watch.connected() == {"trainer": False, "verifier": False, "scorer": False}
    watch.saw(Role.TRAINER)
    watch.saw(Role.VERIFIER)
    now[0] += 100.0  # one version of a real model on a CPU: the trainer makes no call meanwhile
    assert watch.connected() == {"trainer": True, "verifier": False, "scorer": False}
    now[0] += 250.0  # five minutes without a word: that trainer is gone
    assert watch.connected()["trainer"] is False
