"""The env server's pool: real instance processes, each failure mode seen and the instance replaced.

A crash (the instance or its browser killed with SIGKILL), a request past its deadline and a
process tree over its memory cap each fail the request with their own reason, and the next
episode gets a fresh instance; an environment that raises fails one episode only.
"""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest

from decentrl.envd.supervisor import InstanceFailed, Limits, Pool
from decentrl.envd_wire import EnvFailure
from decentrl.proctree import descendants

LIMITS = Limits(step_seconds=20.0, start_seconds=60.0, memory_bytes=2 << 30, sessions=4)


def test_an_instance_serves_sessions_of_a_pure_environment_and_a_crash_replaces_it():
    pool = Pool("tool_use", {"tool_format": "python"}, 1, LIMITS)
    try:
        instance = pool.place("a")
        assert instance.call({"op": "open", "session": "a", "seed": 3}) == {}
        reply = instance.call({"op": "step", "session": "a", "action": "lookup('kibo')"})["reply"]
        assert reply == [{"role": "tool", "content": pool_env_code("kibo")}]
        assert instance.call({"op": "reward", "session": "a", "final_action": "0"})["reward"] == 0.0
        os.kill(instance.pid, signal.SIGKILL)
        with pytest.raises(InstanceFailed) as failed:
            instance.call({"op": "step", "session": "a", "action": "lookup('kibo')"})
        assert failed.value.failure is EnvFailure.CRASH
        fresh = pool.place("b")
        assert fresh is not instance and fresh.alive() and pool.counters["instances_replaced"] == 1
    finally:
        pool.close()


def pool_env_code(name: str) -> str:
    from decentrl.envs.tool_use import ToolUse

    return ToolUse().registry[name]


def test_an_environment_error_fails_one_episode_and_keeps_the_instance():
    pool = Pool("tool_use", {}, 1, LIMITS)
    try:
        instance = pool.place("a")
        with pytest.raises(InstanceFailed) as failed:
            instance.call({"op": "step", "session": "nobody", "action": "x"})  # no such session: KeyError
        assert failed.value.failure is EnvFailure.ERROR and instance.alive()
    finally:
        pool.close()


def test_a_request_past_its_deadline_is_a_timeout_and_the_instance_dies():
    pool = Pool(
        "tool_use", {}, 1, Limits(step_seconds=0.5, start_seconds=60.0, memory_bytes=2 << 30, sessions=4)
    )
    try:
        instance = pool.place("a")
        os.kill(instance.pid, signal.SIGSTOP)  # a hung instance: alive, never answering
        with pytest.raises(InstanceFailed) as failed:
            instance.call({"op": "open", "session": "a", "seed": 1})
        assert failed.value.failure is EnvFailure.TIMEOUT and not instance.alive()
    finally:
        pool.close()


def test_an_instance_over_its_memory_cap_is_killed():
    pool = Pool("tool_use", {}, 1, LIMITS)
    try:
        instance = pool.place("a")
        instance.limits = Limits(step_seconds=20.0, start_seconds=60.0, memory_bytes=1 << 20, sessions=4)
        with pytest.raises(InstanceFailed) as failed:
            instance.call({"op": "open", "session": "a", "seed": 1})  # an open is always measured
        assert failed.value.failure is EnvFailure.MEMORY and not instance.alive()
    finally:
        pool.close()


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Chromium: make browser-tools")
def test_a_killed_browser_crashes_its_instance_and_every_descendant_dies():
    pool = Pool("browser", {}, 1, LIMITS)
    try:
        instance = pool.place("a")
        instance.call({"op": "open", "session": "a", "seed": 0})
        tree = descendants(instance.pid)
        browser = next(pid for pid in tree if pid != instance.pid and b"chromium" in _cmdline(pid))
        os.kill(browser, signal.SIGKILL)
        with pytest.raises(InstanceFailed) as failed:
            instance.call({"op": "step", "session": "a", "action": "click(1)"})
        assert failed.value.failure is EnvFailure.CRASH
        deadline = time.monotonic() + 10  # orphaned renderers are reaped by init, a moment later
        while [pid for pid in tree if _alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in tree if _alive(pid)]  # no renderer left behind
    finally:
        pool.close()


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Grants:
    """The coordinator's side of a reset, recorded (a stand-in for `CoordinatorClient`)."""

    def __init__(self) -> None:
        self.claims = 0

    def envd_claim(self, server_id, lease_id, task_id, slot, env_version):  # noqa: ANN001, ANN201
        from decentrl.envd_wire import EpisodeGrant

        self.claims += 1
        return EpisodeGrant(episode_id=f"e-{self.claims:016x}", attempt=0, env="tool_use", seed=slot)

    def envd_failed(self, report) -> None:  # noqa: ANN001
        raise AssertionError(f"nothing fails here: {report}")


def test_a_full_server_refuses_a_reset_before_any_episode_is_granted():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from decentrl.envd.turns import Episodes, Refused
    from decentrl.envd_wire import EnvLeaseInfo, ResetRequest

    pool = Pool(
        "tool_use", {}, 1, Limits(step_seconds=20.0, start_seconds=60.0, memory_bytes=2 << 30, sessions=1)
    )
    grants = Grants()
    episodes = Episodes(pool, Ed25519PrivateKey.generate(), "envd-test", grants)
    lease = EnvLeaseInfo(
        lease_id="l-1", worker_id="w", worker_public_key="ab" * 32, deadline_unix=time.time() + 60
    )
    try:
        episodes.reset(ResetRequest(lease_id="l-1", task_id="t", slot=0), lease)
        with pytest.raises(Refused) as full:
            episodes.reset(ResetRequest(lease_id="l-1", task_id="t", slot=1), lease)
        assert full.value.status == 503 and grants.claims == 1  # no attempt spent on the full server
    finally:
        pool.close()
