"""The coordinator's side of served environments, without HTTP: episodes granted per leased slot,
retries only after a reported failure, a slot released after its last retry, a task given up,
and the counts /v1/stats shows."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_coordinator_store import Clock, publish_row, write_model_dir

from decentrl.config import CoordinatorConfig, RunConfig, TaskConfig
from decentrl.coordinator import metrics
from decentrl.coordinator.context import build_context
from decentrl.coordinator.env_servers import SERVER_TTL_SECONDS, EnvServers
from decentrl.coordinator.http.errors import ApiError
from decentrl.coordinator.pipeline import leasing
from decentrl.envd_wire import EnvFailure, EnvServerAnnounce, EpisodeClaim, EpisodeFailed
from decentrl.monitor import dashboard_data
from decentrl.protocol import LeaseRequest

KEY = "ab" * 32


@pytest.fixture
def run(tmp_path: Path):
    clock = Clock()
    config = RunConfig(
        coordinator=CoordinatorConfig(group_size=2, max_pending_groups=4),
        task=TaskConfig(served=True, max_env_retries=1, max_env_failures=3),
    )
    context = build_context(config, tmp_path / "run", write_model_dir(tmp_path / "model"), clock)
    publish_row(context, 0)
    with context.store.transaction() as db:  # a registered worker with a key
        db.execute("INSERT INTO worker_keys (worker_id, public_key, registered) VALUES ('w1', ?, 0)", (KEY,))
    servers = EnvServers(context)
    servers.announce(
        EnvServerAnnounce(
            server_id="envd-0",
            url="http://127.0.0.1:9",
            public_key="cd" * 32,
            env="arithmetic",
            env_version="v1",
            instances=1,
            sessions=4,
        )
    )
    lease = leasing.grant_lease(context, "w1", LeaseRequest(policy_version=0, max_groups=1))
    return context, servers, clock, lease


def claim(servers: EnvServers, lease, slot: int = 0) -> object:
    task = lease.tasks[0]
    return servers.claim(
        EpisodeClaim(
            server_id="envd-0", lease_id=lease.lease_id, task_id=task.task_id, slot=slot, env_version="v1"
        )
    )


def fail(servers: EnvServers, episode_id: str, failure: EnvFailure = EnvFailure.CRASH) -> dict:
    return servers.failed(EpisodeFailed(server_id="envd-0", episode_id=episode_id, failure=failure))


def test_one_episode_per_slot_a_retry_only_after_a_failure_and_the_slot_released_after_the_last(run):
    context, servers, clock, lease = run
    info = servers.lease_info(lease.lease_id)
    assert (info.worker_id, info.worker_public_key) == ("w1", KEY)
    first = claim(servers, lease)
    assert first.attempt == 0 and first.seed == lease.tasks[0].seed and first.env == "arithmetic"
    with pytest.raises(ApiError) as going:
        claim(servers, lease)  # a second live episode: the better of two could be kept
    assert going.value.status == 409
    assert fail(servers, first.episode_id) == {"episode_id": first.episode_id, "released": False}
    second = claim(servers, lease)
    assert second.attempt == 1
    assert fail(servers, second.episode_id, EnvFailure.TIMEOUT)["released"] is True  # no retry left
    with pytest.raises(ApiError) as gone:
        claim(servers, lease)
    assert gone.value.status == 422  # the slot left the lease: it is leased again, to anyone
    with context.store.transaction() as db:
        assert db.execute("SELECT lease_id FROM slots WHERE slot = 0").fetchone()[0] is None
    envd = metrics.stats(context)["envd"]
    assert envd["failures"] == {"crash": 1, "timeout": 1} and envd["retries"] == 1
    assert 'decentrl_env_failures_total{reason="timeout"} 1' in metrics.prometheus(metrics.stats(context))
    with context.store.transaction() as db:  # the dashboard's event panel counts them by kind
        kinds = {k["kind"]: k for k in dashboard_data.trust_event_kinds(db)}
    assert kinds["env_failed"]["count"] == 2 and kinds["env_failed"]["last_reason"] == "timeout"


def test_an_open_episode_of_a_silent_server_is_failed_as_lost_and_a_task_given_up(run):
    context, servers, clock, lease = run
    first = claim(servers, lease, slot=1)
    clock.now += SERVER_TTL_SECONDS + 1  # the server stopped announcing
    assert servers.live() == []
    second = claim(servers, lease, slot=1)
    assert second.attempt == 1
    fail(servers, second.episode_id)  # failures of this task: lost, crash
    servers.announce(
        EnvServerAnnounce(
            server_id="envd-0",
            url="http://127.0.0.1:9",
            public_key="cd" * 32,
            env="arithmetic",
            env_version="v1",
            instances=1,
            sessions=4,
        )
    )
    third = claim(servers, lease, slot=0)
    fail(servers, third.episode_id)  # the third failure of the task: given up
    stats = metrics.stats(context)
    assert stats["groups"]["env_failed"] == 1 and stats["envd"]["tasks_given_up"] == 1
    assert stats["envd"]["failures"] == {"crash": 2, "lost": 1}
    assert first.episode_id != second.episode_id
