"""Hostile workers, each a real signed client, against a real coordinator process on loopback.

The model is the tiny default with random weights made confident (its final norm scaled up), so its
next-token distributions are peaked like a trained model's: a pasted answer is then implausible as
a sample, as it is under the warm-started demo model (`decentrl bench adversarial` runs that one,
with many trials). The verifier runs in this process, the coordinator in its own.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from benchmarks.adversarial.arena import Arena
from benchmarks.adversarial.attacks import (
    PROTOCOL_ATTACKS,
    TRIAL_ATTACKS,
    flood,
    honest,
    run_trial,
    submit,
    written,
)
from decentrl.client import RequestRejected
from decentrl.config import ModelConfig
from decentrl.protocol import LeaseRequest, RegisterRequest
from decentrl.trust.logprob_tolerance import CALIBRATED

pytestmark = pytest.mark.integration

GROUPS_PER_LEASE = 2
OVERRIDES = [
    "coordinator.group_size=4",
    "coordinator.max_pending_groups=64",
    "trust.requests_per_second=50",
    "trust.request_burst=100",
    # A newcomer's every rollout is verified (default: half), so that "held until verified" is a
    # certainty here: at 0.5, one submission of 8 rollouts in 256 had none picked and a forger's
    # first submission was trained on (how often the sampled checks catch what is measured by
    # `decentrl bench adversarial` at the default fractions, not by CI).
    "trust.probation_fraction=1.0",
]
PROBATION_SUBMISSIONS = 8
"""Honest submissions that surely end a worker's probation here (2 groups x 4 slots x ~6 tokens each,
all verified, against `trust.probation_tokens` 256)."""


@pytest.fixture(scope="module")
def arena(tmp_path_factory: pytest.TempPathFactory):
    from decentrl.model.tiny import build_tiny, save_model_dir

    model, tokenizer = build_tiny(ModelConfig(hidden_size=64, num_heads=2, intermediate_size=128))
    with torch.no_grad():
        model.model.norm.weight.mul_(30.0)  # confident, like a trained model
    model_dir = save_model_dir(model, tokenizer, tmp_path_factory.mktemp("model"))
    arena = Arena(model_dir, tmp_path_factory.mktemp("run"), OVERRIDES)
    yield arena
    arena.close()


@pytest.mark.parametrize("attack", sorted(PROTOCOL_ATTACKS))
def test_protocol_attack_is_refused_and_stores_nothing(arena: Arena, attack: str) -> None:
    agent = arena.agent(attack)
    try:
        attempt = PROTOCOL_ATTACKS[attack](agent)
    finally:
        agent.close()
    if attack == "claimed_reward":  # valid rollouts, so accepted, but the claim earns nothing
        assert attempt.status == 200 and attempt.stored == 0
    else:
        assert 400 <= attempt.status < 500 and attempt.stored == 0, attempt


def test_flood_is_rate_limited(arena: Arena) -> None:
    agent = arena.agent("flood")
    started = time.monotonic()
    try:
        served, limited = flood(agent, requests=400)
    finally:
        agent.close()
    allowed = 100 + 50 * (time.monotonic() - started)  # burst + rate x duration
    assert limited > 0 and served <= 1.05 * allowed and served + limited == 400, (served, limited)


def test_chunk_downloads_have_their_own_allowance(arena: Arena) -> None:
    """A worker catching up fetches many chunks at once; that must not cost its lease/submit budget
    (burst 100 + 50/s here): 300 chunk GETs from 8 threads, then a lease, with no 429 on the way."""
    agent = arena.agent("catch-up")
    try:
        manifest = json.loads(agent.client.manifest_bytes(0, "snapshot"))
        digest = manifest["chunks"][0]["sha256"]
        with ThreadPoolExecutor(8) as pool:  # ~1 s here; under a shared limit ~200 of them would get 429
            sizes = list(pool.map(lambda _: len(agent.client.chunk(digest)), range(300)))
        assert agent.lease(GROUPS_PER_LEASE).tasks
        assert all(size == manifest["chunks"][0]["size"] for size in sizes)
        assert agent.client.retries == 0, agent.client.retry_reasons
    finally:
        agent.close()


@pytest.mark.parametrize("attack", sorted(TRIAL_ATTACKS))
def test_hostile_sampler_is_quarantined_and_its_rollouts_discarded(arena: Arena, attack: str) -> None:
    trial = run_trial(arena, TRIAL_ATTACKS[attack], max_submissions=20, groups_per_lease=GROUPS_PER_LEASE)
    assert trial.quarantined_after is not None and trial.quarantined_after <= 20, trial
    if attack == "forged_logprobs":  # one recomputation convicts: held until verified, then discarded
        assert trial.rollouts_kept == 0, trial
    else:  # rollouts that passed their checks before the conviction (a version claim is only caught
        # where the versions' log-probs differ by more than the tolerance) were trained on
        assert trial.rollouts_kept < trial.submissions * GROUPS_PER_LEASE * 4, trial
    assert arena.stored(trial.worker_id) == arena.trained(trial.worker_id)  # nothing untrained is left
    events = arena.query("SELECT kind FROM events WHERE worker_id = ? ORDER BY seq", trial.worker_id)
    assert ("quarantined",) in events and ("discarded",) in events


def test_turncoat_after_honest_period_is_quarantined(arena: Arena) -> None:
    """Past its probation (sampled checks are rare now), a worker starts pasting answers: its groups'
    slots repeat each other, which the coordinator sees in the first hostile submission."""
    trial = run_trial(
        arena, TRIAL_ATTACKS["written_not_sampled"], 20, GROUPS_PER_LEASE, honest_before=PROBATION_SUBMISSIONS
    )
    verified = arena.query("SELECT tokens_verified FROM reputation WHERE worker_id = ?", trial.worker_id)
    assert verified[0][0] >= arena.config.trust.probation_tokens
    assert trial.quarantined_after == 1 and trial.rollouts_kept == 0, trial
    reason = arena.quarantined(trial.worker_id)
    assert reason is not None and "repeat each other" in reason


def test_honest_worker_is_trained_on_and_keeps_its_standing(arena: Arena) -> None:
    trial = run_trial(arena, honest, max_submissions=12, groups_per_lease=GROUPS_PER_LEASE)
    assert trial.quarantined_after is None and trial.rollouts_kept > 0, trial


def test_quarantine_survives_reregistration_with_the_same_key(arena: Arena) -> None:
    agent = arena.agent("twice")
    try:
        for _ in range(5):
            try:
                submit(agent, TRIAL_ATTACKS["forged_logprobs"](agent, agent.lease(GROUPS_PER_LEASE)))
            except RequestRejected as exc:
                assert exc.status == 403
                break
            arena.settle()
        assert arena.quarantined(agent.worker_id)
        request = RegisterRequest(name="twice", public_key=agent.signer.public_key)
        again = agent.client.register(request, arena.enroll_token)
        assert again.worker_id == agent.worker_id  # one key, one identity
        agent.client.token = again.token
        with pytest.raises(RequestRejected) as refused:
            agent.client.lease(LeaseRequest(policy_version=arena.latest, max_groups=1))
        assert refused.value.status == 403 and "quarantined" in refused.value.detail
    finally:
        agent.close()


def test_a_forger_declaring_the_loosest_engine_class_is_caught_at_once(arena: Arena) -> None:
    """A float32 worker registers as bfloat16 (the loosest tolerance, no per-token bound to speak of)
    and claims every token 0.1 nats less likely than it was (inflating the trainer's importance
    weights by 10 % per token): the mean test quarantines it on its first verified submission."""
    agent = arena.agent("liar", dtype="bfloat16")
    try:
        rollouts = agent.play(agent.lease(GROUPS_PER_LEASE))
        for rollout in rollouts:
            for segment in rollout.segments:
                if segment.logprobs:
                    segment.logprobs = [value - 0.1 for value in segment.logprobs]
        submit(agent, rollouts)
        arena.settle()
        reason = arena.quarantined(agent.worker_id)
        assert reason is not None and "mean tolerance" in reason, reason
        info = arena.trainer.info()
        assert arena.trainer.stats()["trust"]["logprob_tolerances"] == info.logprob_tolerances
        assert info.logprob_tolerances["*/bfloat16"] == CALIBRATED["*/bfloat16"].model_dump()
        assert arena.query("SELECT dtype FROM workers WHERE worker_id = ?", agent.worker_id) == [
            ("bfloat16",)
        ]
    finally:
        agent.close()


def test_a_wrong_version_claim_hidden_in_bf16_tolerance_is_caught_by_the_version_test(arena: Arena) -> None:
    """Declared bfloat16, whose error tolerance is wider than the gap between consecutive versions,
    a worker samples with the version before the latest and claims the latest: the verifier finds
    the claims closer to that older version and the version test quarantines it at its first
    submission. An honest worker declaring bfloat16 keeps its standing over more submissions."""
    trial = run_trial(arena, TRIAL_ATTACKS["wrong_version_claim"], 20, GROUPS_PER_LEASE, dtype="bfloat16")
    assert trial.quarantined_after == 1 and trial.rollouts_kept == 0, trial
    reason = arena.quarantined(trial.worker_id)
    assert reason is not None and "wrong version claim" in reason, reason
    fair = run_trial(arena, honest, 4, GROUPS_PER_LEASE, name="honest-bf16", dtype="bfloat16")
    assert fair.quarantined_after is None and fair.rollouts_kept > 0, fair
    detector = arena.query("SELECT version_detector FROM reputation WHERE worker_id = ?", fair.worker_id)
    assert detector[0][0] is not None and detector[0][0] < -10


def test_pasted_answers_sent_one_rollout_per_submission_are_caught(arena: Arena) -> None:
    """Past its probation (sampled checks are rare), a worker pastes answers and splits its leases
    into one-rollout submissions: the repeats still add up, because a group's reference slot is the
    first one the worker ever sent for it, whichever submission carried it."""
    agent = arena.agent("drip")
    hostile: list[str] = []
    try:
        for _ in range(PROBATION_SUBMISSIONS):
            submit(agent, honest(agent, agent.lease(GROUPS_PER_LEASE)))
            arena.settle()
        statuses = []
        for _ in range(2):
            lease = agent.lease(GROUPS_PER_LEASE)
            hostile.append(lease.lease_id)
            for rollout in written(agent, lease):
                statuses.append(submit(agent, [rollout]))
                arena.settle()
                if statuses[-1] == 403 or arena.quarantined(agent.worker_id):
                    break
            if arena.quarantined(agent.worker_id):
                break
        reason = arena.quarantined(agent.worker_id)
        assert reason is not None and "repeat each other" in reason, (reason, statuses)
        assert arena.trained(agent.worker_id, hostile) == 0
    finally:
        agent.close()


def test_an_address_out_of_allowance_is_answered_late_and_the_token_it_carries_keeps_working(
    arena: Arena,
) -> None:
    """An observer sends junk signatures with a victim's token until its address's allowance is
    spent: from then on each refusal comes a second late (one answer a second per connection), and
    the victim, whose token those requests carry, leases at once meanwhile. (That the waiting
    refusals hold none of the token's share of requests in flight: tests/unit/test_request_budget.py.)"""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from benchmarks.adversarial.senders import address
    from decentrl.protocol import API_PREFIX
    from decentrl.trust.identity import Signer

    victim = arena.agent("tarpit-victim")
    path = f"{API_PREFIX}/leases"
    body = LeaseRequest(policy_version=arena.latest, max_groups=1).model_dump_json().encode()
    junk = {
        "Authorization": f"Bearer {victim.client.token}",
        "Content-Type": "application/json",
        **Signer(Ed25519PrivateKey.generate()).headers("POST", path, body),
    }
    observer = httpx.Client(
        transport=httpx.HTTPTransport(local_address=address(350)),
        timeout=30,
        limits=httpx.Limits(max_connections=12),
    )

    def send() -> tuple[int, float, dict]:
        started = time.monotonic()
        answer = observer.post(arena.url + path, content=body, headers=junk)
        return answer.status_code, time.monotonic() - started, dict(answer.headers)

    try:
        first = [send() for _ in range(400)]  # the burst (100) and a few seconds' rate (50/s) at most
        spent = next(index for index, (status, _, _) in enumerate(first) if status == 429)
        assert {status for status, _, _ in first[:spent]} == {401}
        # 12 connections (under the token's share of 16) keep at it for 2.5 s: the allowance refills
        # at 50/s, each refill is spent on fast 401s, and then every connection waits in a refusal
        deadline = time.monotonic() + 2.5

        def keep_sending() -> list[tuple[int, float, dict]]:
            answers = []
            while time.monotonic() < deadline:
                answers.append(send())
            return answers

        with ThreadPoolExecutor(12) as pool:
            waiting = [pool.submit(keep_sending) for _ in range(12)]
            time.sleep(1.0)
            started = time.monotonic()
            lease = victim.client.lease(LeaseRequest(policy_version=arena.latest, max_groups=1))
            victim_seconds = time.monotonic() - started
            late = [answer for future in waiting for answer in future.result()]
    finally:
        observer.close()
    assert lease is not None and victim_seconds < 0.9, victim_seconds
    refused = [(seconds, headers) for status, seconds, headers in [first[spent], *late] if status == 429]
    assert {status for status, _, _ in late} == {401, 429} and len(refused) >= 12
    for seconds, headers in refused:
        assert seconds >= 0.95 and headers.get("retry-after") == "0"  # the wait was the lateness
        assert "x-decentrl-tarpit" not in headers
    # what reached the gate's checks: the refills of the allowance (50/s), nothing more
    assert sum(status == 401 for status, _, _ in late) <= 50 * 3.5
    assert arena.quarantined(victim.worker_id) is None
    victim.close()
