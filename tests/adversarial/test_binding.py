"""Bind before anything costly: a submission that does not bind to the worker's own open slots is
refused (with a strike where only a hostile worker sends it) before its episodes are replayed, and
scoring is budgeted per worker. Rewards are scored after the answer, in the scoring pool: a
completion that loops forever costs the pool its timeout, never the submission's request, and the
pool's seconds are charged to the worker that sent it.

The code environment, whose hidden tests run in the sandbox. A real coordinator process, real
signed clients.
"""

from __future__ import annotations

import time

import pytest
from tokenizers import Tokenizer

from adversarial.processes import confident_arena
from benchmarks.adversarial.arena import Agent, Arena
from benchmarks.adversarial.attacks import submit
from decentrl.protocol import Rollout

pytestmark = pytest.mark.integration

CPU_SECONDS = 2
OVERRIDES = [
    'task.env="code"',
    f"task.args={{sandbox={{cpu_seconds={CPU_SECONDS}, wall_seconds=4.0}}}}",
    "coordinator.group_size=2",
    "coordinator.max_new_tokens=24",
    "trust.verify_fraction=0.0",
    # A budget of three seconds of scoring, refilled at 1 µs/s: a submission needs one second of
    # credit; the replay of a group costs milliseconds, scoring its two looping rollouts in the pool
    # at least 2 * CPU_SECONDS.
    "trust.scoring_seconds_per_second=0.000001",
    "trust.scoring_burst_seconds=3.0",
]
LOOP = "while {}:pass"


@pytest.fixture(scope="module")
def arena(tmp_path_factory: pytest.TempPathFactory):
    with confident_arena(tmp_path_factory, OVERRIDES, num_versions=1) as arena:
        yield arena


def looping(arena: Arena, rollout: Rollout) -> Rollout:
    """`rollout` with its completion replaced by code that never ends (its own claimed log-probs; a
    different loop per slot, so that the slots do not repeat each other)."""
    tokenizer = Tokenizer.from_file(str(arena.model_dir / "tokenizer.json"))
    eos = arena.trainer.info().eos_token_ids[0]
    ids = [*tokenizer.encode(LOOP.format(rollout.slot + 1), add_special_tokens=False).ids, eos]
    segment = rollout.segments[0].model_copy(
        update={"token_ids": ids, "logprobs": [-1.0] * len(ids), "policy_versions": [arena.latest] * len(ids)}
    )
    return rollout.model_copy(update={"segments": [segment], "finish_reason": "stop"})


def timed_submit(agent: Agent, rollouts: list[Rollout]) -> tuple[int, float]:
    started = time.monotonic()
    status = submit(agent, rollouts)
    return status, time.monotonic() - started


def test_unbound_submissions_are_refused_before_scoring(arena: Arena) -> None:
    agent = arena.agent("binder")
    try:
        lease = agent.lease(1)
        rollouts = [looping(arena, rollout) for rollout in agent.play(lease)]
        foreign = [r.model_copy(update={"lease_id": "l-0000000000000000"}) for r in rollouts]
        status, seconds = timed_submit(agent, foreign)  # no such lease: refused, nothing replayed
        assert status == 404 and seconds < CPU_SECONDS / 2, (status, seconds)
        status, seconds = timed_submit(agent, rollouts[:1])  # bound: accepted; scored after the answer
        assert status == 200 and seconds < CPU_SECONDS / 2, (status, seconds)
        status, seconds = timed_submit(agent, rollouts[:1])  # an already filled slot: refused first
        assert status == 409 and seconds < CPU_SECONDS / 2, (status, seconds)
        strikes = arena.query(
            "SELECT reason FROM events WHERE kind = 'violation' AND worker_id = ?", agent.worker_id
        )
        assert strikes == [("unknown_lease",)]
    finally:
        agent.close()


def scored(arena: Arena, worker_id: str, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    query = "SELECT COUNT(*) FROM reward_scores WHERE worker_id = ?"
    while arena.query(query, worker_id)[0][0] < count:
        assert time.monotonic() < deadline, f"the pool did not score {count} rollouts in {timeout:g}s"
        time.sleep(0.2)


def test_scoring_pool_time_is_charged_to_the_worker(arena: Arena) -> None:
    """Code that runs to the sandbox's limit costs the pool seconds after the answer; they come out
    of the sender's budget (429 once spent, no strike: slow code proves nothing), not the others'."""
    hog, honest = arena.agent("hog"), arena.agent("honest")
    hog.client.retry_rate_limited = False  # see the 429 instead of waiting it out
    try:
        assert submit(hog, [looping(arena, rollout) for rollout in hog.play(hog.lease(1))]) == 200
        scored(arena, hog.worker_id, 2)  # 2 * CPU_SECONDS of pool time: past the 3 s budget
        assert submit(hog, [looping(arena, rollout) for rollout in hog.play(hog.lease(1))]) == 429
        assert submit(honest, honest.play(honest.lease(1))) == 200  # its own budget is untouched
        strikes = arena.query(
            "SELECT reason FROM events WHERE kind = 'violation' AND worker_id = ?", hog.worker_id
        )
        assert strikes == []
    finally:
        hog.close()
        honest.close()
