"""Hostile workers: each attack is a real client doing one wrong thing against the `Arena`.

Protocol attacks (`PROTOCOL_ATTACKS`) make single attempts that the coordinator must refuse with a
4xx while storing nothing. Statistical attacks (`TRIAL_ATTACKS`) are workers that keep submitting
plausible-looking rollouts until they are quarantined (or `max_submissions` runs out); each trial
is a fresh identity. Every function returns how it went, so tests and the benchmark share them.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from benchmarks.adversarial.arena import Agent, Arena
from decentrl.algo.logprobs import logprobs_from_logits
from decentrl.client import RequestRejected
from decentrl.protocol import API_PREFIX, Lease, Rollout, RolloutSubmission, Segment, TaskSpec
from decentrl.trust.identity import Signer


@dataclass
class Attempt:
    status: int
    """HTTP status of the hostile request (200 = accepted)."""
    stored: int
    """Rollouts the attacker has in the store afterwards (beyond what it stored honestly before)."""


def submit(agent: Agent, rollouts: list[Rollout]) -> int:
    try:
        agent.client.submit_rollouts(RolloutSubmission(rollouts=rollouts))
        return 200
    except RequestRejected as exc:
        return exc.status


def _mutated(agent: Agent, change: Callable[[Rollout, Lease], None], max_groups: int = 1) -> Attempt:
    """Play a lease honestly, apply `change` to the first rollout, submit them all."""
    before = agent.arena.stored(agent.worker_id)
    lease = agent.lease(max_groups)
    rollouts = agent.play(lease)
    change(rollouts[0], lease)
    status = submit(agent, rollouts)
    return Attempt(status, agent.arena.stored(agent.worker_id) - before)


def prompt_swap(agent: Agent) -> Attempt:
    def change(rollout: Rollout, lease: Lease) -> None:
        rollout.prompt_token_ids = rollout.prompt_token_ids[::-1]

    return _mutated(agent, change)


def out_of_vocabulary(agent: Agent) -> Attempt:
    def change(rollout: Rollout, lease: Lease) -> None:
        rollout.segments[0].token_ids[0] = 10**6

    return _mutated(agent, change)


def staleness(agent: Agent) -> Attempt:
    """Sampled with a version older than latest - max_staleness, claimed as such."""
    oldest = agent.arena.latest - agent.arena.config.coordinator.max_staleness - 1
    before = agent.arena.stored(agent.worker_id)
    lease = agent.lease(1)
    status = submit(agent, agent.play(lease, version=oldest))
    return Attempt(status, agent.arena.stored(agent.worker_id) - before)


def claimed_reward(agent: Agent) -> Attempt:
    """Wrong answers that claim reward 1: accepted as rollouts, but scored by the coordinator."""

    def rewarded() -> int:
        query = "SELECT COUNT(*) FROM rollouts WHERE worker_id = ? AND reward > 0"
        return agent.arena.query(query, agent.worker_id)[0][0]

    def scored() -> None:  # rewards are computed after the answer, in the coordinator's scoring pool
        deadline = time.monotonic() + 60
        query = "SELECT COUNT(*) FROM reward_pending WHERE worker_id = ?"
        while agent.arena.query(query, agent.worker_id)[0][0] and time.monotonic() < deadline:
            time.sleep(0.05)

    before = rewarded()
    rollouts = written(agent, agent.lease(1), wrong=True)
    for rollout in rollouts:
        rollout.claimed_reward = 1.0
    status = submit(agent, rollouts)
    scored()
    return Attempt(status, rewarded() - before)  # "stored" here: rollouts that earned the claimed reward


def duplicate(agent: Agent) -> Attempt:
    """One accepted rollout, then the same slot again in a new submission and twice in one."""
    lease = agent.lease(1)
    rollouts = agent.play(lease)
    assert submit(agent, rollouts[:1]) == 200
    before = agent.arena.stored(agent.worker_id)
    again = submit(agent, rollouts[:1])
    twice = submit(agent, [rollouts[1], rollouts[1]])
    status = max(again, twice) if min(again, twice) >= 400 else 200
    return Attempt(status, agent.arena.stored(agent.worker_id) - before)


def replay(agent: Agent) -> Attempt:
    """The exact bytes of an accepted, signed submission sent a second time."""
    lease = agent.lease(1)
    body = RolloutSubmission(rollouts=agent.play(lease)).model_dump_json().encode()
    http = agent.client._http
    request = http.build_request("POST", "/rollouts", content=body, headers=_json_auth(agent))
    request.headers.update(agent.signer.headers("POST", API_PREFIX + "/rollouts", body))
    assert http.send(request).status_code == 200
    before = agent.arena.stored(agent.worker_id)
    status = http.send(request).status_code
    return Attempt(status, agent.arena.stored(agent.worker_id) - before)


def _json_auth(agent: Agent) -> dict[str, str]:
    return {"Authorization": f"Bearer {agent.client.token}", "Content-Type": "application/json"}


def _raw(agent: Agent, body: bytes, signer: Signer | None, token: str | None) -> Attempt:
    before = agent.arena.stored(agent.worker_id)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if signer:
        headers.update(signer.headers("POST", API_PREFIX + "/rollouts", body))
    response = httpx.post(
        f"{agent.arena.url}{API_PREFIX}/rollouts", content=body, headers=headers, timeout=60
    )
    return Attempt(response.status_code, agent.arena.stored(agent.worker_id) - before)


def _valid_body(agent: Agent) -> bytes:
    return RolloutSubmission(rollouts=agent.play(agent.lease(1))).model_dump_json().encode()


def unauthenticated(agent: Agent) -> Attempt:
    return _raw(agent, _valid_body(agent), signer=None, token=None)


def forged_signature(agent: Agent) -> Attempt:
    """The worker's token, but a signature by another key."""
    return _raw(agent, _valid_body(agent), Signer(Ed25519PrivateKey.generate()), agent.client.token)


def malformed_body(agent: Agent) -> Attempt:
    return _raw(agent, b'{"rollouts": [{"slot": "x"', agent.signer, agent.client.token)


def oversized_payload(agent: Agent) -> Attempt:
    limit = agent.arena.config.coordinator.max_body_bytes
    return _raw(agent, b" " * (limit + 1), agent.signer, agent.client.token)


def flood(agent: Agent, requests: int = 400, threads: int = 16) -> tuple[int, int]:
    """`requests` signed requests from `threads` threads at once: (served, refused with 429)."""
    agent.client.retry_rate_limited = False  # count the 429s instead of waiting them out

    def one(_: int) -> int:
        try:
            agent.client.info()
            return 200
        except RequestRejected as exc:
            return exc.status

    with ThreadPoolExecutor(threads) as pool:
        statuses = list(pool.map(one, range(requests)))
    return statuses.count(200), statuses.count(429)


PROTOCOL_ATTACKS: dict[str, Callable[[Agent], Attempt]] = {
    "prompt_swap": prompt_swap,
    "out_of_vocabulary": out_of_vocabulary,
    "staleness_beyond_bound": staleness,
    "claimed_reward": claimed_reward,
    "duplicate_submission": duplicate,
    "replay_accepted_rollout": replay,
    "unauthenticated": unauthenticated,
    "forged_signature": forged_signature,
    "malformed_body": malformed_body,
    "oversized_payload": oversized_payload,
}


# ---------------------------------------------------------------- statistical attacks


def answer_of(prompt_text: str, wrong: bool = False) -> str:
    """The reference answer of an arithmetic prompt, read from its text: raw ("12+34=") or in a
    chat template ("What is 12 + 34?")."""
    found = re.findall(r"(-?\d+)\s*([+\-*])\s*(\d+)\s*(?:=|\?)", prompt_text)
    assert found, f"not an arithmetic prompt: {prompt_text!r}"
    left, operator, right = found[-1]
    value = {"+": int(left) + int(right), "-": int(left) - int(right), "*": int(left) * int(right)}[operator]
    return str(value + 1 if wrong else value)


def written_rollouts(lease: Lease, segment_of: Callable[[TaskSpec, int], Segment]) -> list[Rollout]:
    """Every slot of `lease` answered with one written model turn, `segment_of(task, slot)`."""
    return [
        Rollout(
            lease_id=lease.lease_id,
            task_id=task.task_id,
            slot=slot,
            prompt_token_ids=task.prompt_token_ids,
            segments=[segment_of(task, slot)],
            sampling=lease.sampling,
            finish_reason="stop",
        )
        for task in lease.tasks
        for slot in task.slots
    ]


@torch.no_grad()
def written(agent: Agent, lease: Lease, wrong: bool = False) -> list[Rollout]:
    """The reference answer pasted into every slot, with log-probs honestly computed for it."""
    arena = agent.arena
    scorer = arena.scorer()
    tokenizer, eos = arena.player.chat.tokenizer, arena.player.chat.eos_token_ids[0]
    temperature = lease.sampling.temperature
    segments = {}
    for task in lease.tasks:
        answer = tokenizer.encode(answer_of(tokenizer.decode(task.prompt_token_ids), wrong)).ids + [eos]
        ids = torch.tensor([task.prompt_token_ids + answer])
        logits = scorer(input_ids=ids).logits[0, len(task.prompt_token_ids) - 1 : -1]
        logprobs = logprobs_from_logits(logits, torch.tensor(answer), temperature).tolist()
        segments[task.task_id] = Segment(
            source="model", token_ids=answer, logprobs=logprobs, policy_versions=[arena.latest] * len(answer)
        )
    return written_rollouts(lease, lambda task, _slot: segments[task.task_id])


def forged_logprobs(agent: Agent, lease: Lease) -> list[Rollout]:
    """Honest samples whose claimed log-probs are halved (inflating the trainer's importance weights)."""
    rollouts = agent.play(lease)
    for rollout in rollouts:
        for segment in rollout.segments:
            if segment.logprobs:
                segment.logprobs = [value / 2 for value in segment.logprobs]
    return rollouts


def wrong_version(agent: Agent, lease: Lease) -> list[Rollout]:
    """Sampled with an older (allowed) version, claimed as the latest."""
    rollouts = agent.play(lease, version=agent.arena.latest - 1)
    for rollout in rollouts:
        for segment in rollout.segments:
            if segment.policy_versions:
                segment.policy_versions = [agent.arena.latest] * len(segment.policy_versions)
    return rollouts


def honest(agent: Agent, lease: Lease) -> list[Rollout]:
    return agent.play(lease)


def written_one_slot(agent: Agent, lease: Lease) -> list[Rollout]:
    """An evasion of the repeated-completion test: the reference answer pasted into the first slot of
    each group, honest samples in the others (one written rollout in `group_size`)."""
    pasted = {(rollout.task_id, rollout.slot): rollout for rollout in written(agent, lease)}
    firsts = {(task.task_id, min(task.slots)) for task in lease.tasks}
    return [pasted[key] if (key := (r.task_id, r.slot)) in firsts else r for r in agent.play(lease)]


TRIAL_ATTACKS: dict[str, Callable[[Agent, Lease], list[Rollout]]] = {
    "forged_logprobs": forged_logprobs,
    "written_not_sampled": written,
    "wrong_version_claim": wrong_version,
}
EVASIONS: dict[str, Callable[[Agent, Lease], list[Rollout]]] = {
    "written_one_slot_per_group": written_one_slot
}
"""Attacks built to slip past a detector; measured (and reported) by the benchmark, not required."""


@dataclass
class Trial:
    quarantined_after: int | None
    """Submissions sent until the worker was quarantined (None: never, within the trial)."""
    submissions: int
    rollouts_kept: int
    """Hostile rollouts still in the store at the end: trained, or waiting for the trainer (a
    quarantine discards those not yet trained), so they reach the loss."""
    worker_id: str = ""


def run_trial(
    arena: Arena,
    behaviour: Callable[[Agent, Lease], list[Rollout]],
    max_submissions: int,
    groups_per_lease: int,
    honest_before: int = 0,
    name: str = "trial",
    dtype: str | None = None,
) -> Trial:
    """A fresh identity (declaring `dtype`, if given, as its engine's): `honest_before` honest
    submissions, then `behaviour` until quarantined."""
    agent = arena.agent(name, dtype)
    hostile_leases: list[str] = []

    def outcome(quarantined_after: int | None, submissions: int) -> Trial:
        kept = arena.stored(agent.worker_id, hostile_leases)
        return Trial(quarantined_after, submissions, kept, agent.worker_id)

    try:
        for index in range(honest_before + max_submissions):
            hostile = index >= honest_before
            try:
                lease = agent.lease(groups_per_lease)
                if hostile:
                    hostile_leases.append(lease.lease_id)
                status = submit(agent, (behaviour if hostile else honest)(agent, lease))
            except RequestRejected as exc:
                status = exc.status
            if status == 403:
                return outcome(index - honest_before, index)
            arena.settle()
            if arena.quarantined(agent.worker_id):
                return outcome(index + 1 - honest_before, index + 1)
        return outcome(None, honest_before + max_submissions)
    finally:
        agent.close()
