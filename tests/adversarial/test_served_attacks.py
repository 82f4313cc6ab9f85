"""Hostile workers against a served environment: the env server's signed turns cannot be forged,
reordered, replayed, borrowed from another episode, or replaced by a claimed reward.

A real coordinator process whose task is served, a real env server (in this process, its own
instance processes), real signed worker clients. Every attack is a submission the coordinator
refuses with a 4xx naming the problem, stores nothing of, and charges as a strike to the worker
that sent it, never to the worker whose records were taken.
"""

from __future__ import annotations

import os
import signal

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from adversarial.served_support import ServedArena, served_arena
from decentrl.client import RequestRejected
from decentrl.envd_wire import EnvEnd, ServedEpisode
from decentrl.protocol import Rollout, RolloutSubmission, Segment
from decentrl.trust.identity import Signer

pytestmark = pytest.mark.integration

TURNS = ["lookup('{name}')", "123{i}"]
"""A tool call, then an answer: two signed steps per episode (the second ends it)."""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with served_arena(tmp_path_factory) as arena:
        yield arena


def honest(served: ServedArena, name: str):
    agent = served.arena.agent(name)
    lease = agent.lease(max_groups=1)
    return agent, lease, served.play(agent, lease, TURNS)


def refused(served: ServedArena, agent, rollouts: list[Rollout], reason: str) -> str:
    """Submit; assert a 422 naming `reason`, nothing stored for the agent, one strike charged."""
    before = served.violations(agent.worker_id)
    with pytest.raises(RequestRejected) as rejected:
        agent.client.submit_rollouts(RolloutSubmission(rollouts=rollouts))
    assert rejected.value.status == 422, rejected.value.detail
    assert served.arena.stored(agent.worker_id) == 0
    assert (
        served.arena.query("SELECT COUNT(*) FROM events WHERE kind = 'rejected' AND reason = ?", reason)[0][0]
        >= 1
    )
    assert served.violations(agent.worker_id) == before + 1
    return rejected.value.detail


def with_served(rollout: Rollout, record: ServedEpisode) -> Rollout:
    return rollout.model_copy(update={"served": record})


def test_an_honest_served_episode_is_accepted_with_the_signed_reward(served):
    agent, lease, rollouts = honest(served, "honest-0")
    assert all(r.served is not None and len(r.served.steps) == 2 for r in rollouts)
    result = agent.client.submit_rollouts(RolloutSubmission(rollouts=rollouts))
    assert len(result.accepted) == len(rollouts) == 2
    assert served.violations(agent.worker_id) == 0


def test_a_forged_observation_or_reward_is_refused(served):
    agent, lease, rollouts = honest(served, "forger")
    record = rollouts[0].served
    forged = record.model_copy(deep=True)
    forged.steps[0].observation[0].content = "4321"  # a tool result the environment never gave
    detail = refused(served, agent, [with_served(rollouts[0], forged)], "env_signature")
    assert "is not signed by env server envd-test" in detail
    claimed = record.model_copy(deep=True)
    claimed.end.reward = 1.0
    assert record.end.reward == 0.0  # "1230" is not the code looked up
    refused(served, agent, [with_served(rollouts[0], claimed)], "env_signature")


def test_records_signed_by_the_worker_itself_are_refused(served):
    from decentrl.envd_wire import signed_bytes

    agent, lease, rollouts = honest(served, "self-signer")
    key = Ed25519PrivateKey.generate()
    record = rollouts[0].served.model_copy(deep=True)
    record.end.reward = 1.0
    for item in (*record.steps, record.end):
        item.signature = key.sign(signed_bytes(item)).hex()
    refused(served, agent, [with_served(rollouts[0], record)], "env_signature")


def test_reordered_steps_are_refused(served):
    agent, lease, rollouts = honest(served, "reorderer")
    record = rollouts[0].served.model_copy(deep=True)
    record.steps.reverse()
    detail = refused(served, agent, [with_served(rollouts[0], record)], "env_mismatch")
    assert "signed step 1 is turn 2" in detail


def test_turns_of_another_episode_or_slot_are_refused(served):
    agent, lease, rollouts = honest(served, "borrower")
    first, second = rollouts
    mixed = first.served.model_copy(deep=True)
    mixed.steps[1] = second.served.steps[1]  # signed, but by the episode of the other slot
    assert "of episode" in refused(served, agent, [with_served(first, mixed)], "env_mismatch")
    swapped = with_served(first, second.served)  # a whole episode granted to the other slot
    assert f"slot {second.slot}" in refused(served, agent, [swapped], "env_signature")


def test_an_episode_replayed_from_an_accepted_rollout_or_another_worker_is_refused(served):
    victim, _, stolen = honest(served, "victim")
    victim.client.submit_rollouts(RolloutSubmission(rollouts=stolen))  # accepted: the records are spent
    agent, lease, rollouts = honest(served, "replayer")
    detail = refused(served, agent, [with_served(rollouts[0], stolen[0].served)], "env_signature")
    assert "was granted to lease" in detail
    assert served.violations(victim.worker_id) == 0  # the worker robbed is never charged


def test_a_claimed_reward_without_signed_turns_is_refused(served):
    agent, lease, rollouts = honest(served, "claimer")
    claim = rollouts[0].model_copy(update={"served": None, "claimed_reward": 1.0})
    assert "signed turns" in refused(served, agent, [claim], "env_signature")


def test_tokens_that_decode_to_another_action_than_the_server_saw_are_refused(served):
    agent, lease, rollouts = honest(served, "two-faced")
    rollout = rollouts[0]
    other = served.tokenizer.encode("lookup('kiba')").ids + [served.eos]
    first = rollout.segments[0]
    changed = Segment(
        source="model",
        token_ids=other,
        logprobs=[-1.0] * len(other),
        policy_versions=first.policy_versions[:1] * len(other),
    )
    tampered = rollout.model_copy(update={"segments": [changed, *rollout.segments[1:]]})
    assert "answers another action" in refused(served, agent, [tampered], "env_mismatch")


def test_a_failed_episode_is_never_accepted_and_a_slot_is_not_played_twice(served):
    agent = served.arena.agent("failer")
    lease = agent.lease(max_groups=1)
    task = lease.tasks[0]
    fleet = served.fleet(agent)
    remote = fleet.reset(lease.lease_id, task.task_id, task.slots[0])
    from decentrl.worker.fleet import EnvServerDown

    with pytest.raises(EnvServerDown) as twice:  # a second live episode for the slot: refused
        fleet.reset(lease.lease_id, task.task_id, task.slots[0])
    assert twice.value.status == 409
    instance = served.envd.pool.instances[0]
    os.kill(instance.pid, signal.SIGKILL)
    problem = fleet.responder(remote)(None, [{"role": "assistant", "content": "lookup('kibo')"}])
    assert problem is None and remote.end is not None and remote.end.failure == "crash"
    ids = [*served.tokenizer.encode("lookup('kibo')").ids, served.eos]
    segment = Segment(
        source="model",
        token_ids=ids,
        logprobs=[-1.0] * len(ids),
        policy_versions=[served.arena.latest] * len(ids),
    )
    failed = Rollout(
        lease_id=lease.lease_id,
        task_id=task.task_id,
        slot=task.slots[0],
        prompt_token_ids=task.prompt_token_ids,
        segments=[segment],
        sampling=lease.sampling,
        finish_reason="stop",
    )
    record = ServedEpisode(steps=[], end=EnvEnd.model_validate(remote.end.model_dump()))
    assert "failed (crash)" in refused(served, agent, [with_served(failed, record)], "env_signature")
    stats = served.arena.trainer.stats()["envd"]
    assert stats["failures"].get("crash", 0) >= 1


def test_an_unsigned_request_to_the_env_server_is_refused(served):
    import httpx

    agent = served.arena.agent("anonymous")
    lease = agent.lease(max_groups=1)
    body = {"lease_id": lease.lease_id, "task_id": lease.tasks[0].task_id, "slot": lease.tasks[0].slots[0]}
    answer = httpx.post(f"{served.envd.url}/envd/reset", json=body, timeout=10)
    assert answer.status_code == 401
    other = Signer(Ed25519PrivateKey.generate())  # a key the lease's worker did not register
    answer = httpx.post(f"{served.envd.url}/envd/reset", json=body, timeout=10, auth=other)
    assert answer.status_code == 401
