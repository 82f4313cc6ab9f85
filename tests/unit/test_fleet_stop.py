"""A stopping worker opens no more served episodes: its lease is not going to be submitted, and
waiting for env servers (up to a minute each) or retrying kept a stopped worker alive for minutes
once its coordinator was gone."""

from __future__ import annotations

import threading
import time

import pytest

from decentrl.worker.fleet import EnvFleet, EnvServerDown


class Unreachable:
    """A coordinator client whose every call would wait: the fleet must not call it."""

    calls = 0

    def env_servers(self):  # noqa: ANN201
        Unreachable.calls += 1
        time.sleep(1)
        return []


def test_a_stopping_fleet_opens_nothing_and_returns_at_once() -> None:
    stop = threading.Event()
    stop.set()
    fleet = EnvFleet(Unreachable(), signer=None, retries=3, stop=stop)  # type: ignore[arg-type]
    started = time.monotonic()
    assert fleet._open("lease-1", "task-1", 0) is None  # the slot goes back with its lease
    assert time.monotonic() - started < 1.0 and Unreachable.calls == 0


def test_a_running_fleet_still_waits_for_servers_until_stopped() -> None:
    stop = threading.Event()
    fleet = EnvFleet(Unreachable(), signer=None, retries=0, stop=stop)  # type: ignore[arg-type]
    Unreachable.calls = 0
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    with pytest.raises(EnvServerDown, match="no env server is live"):  # the wait, cut short
        fleet.reset("lease-1", "task-1", 0)
    # one listing (1 s) and no more rounds of waiting after the stop
    assert Unreachable.calls == 1 and time.monotonic() - started < 5.0
