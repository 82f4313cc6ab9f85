"""Simulated workers of `decentrl bench coordinator`: real clients, real keys, real signed requests.

One process runs many worker threads (the coordinator is the thing measured, so the load comes from
processes of its own). Each thread registers an Ed25519 key like a worker, then loops over what a
worker's loop sends the coordinator: `GET /weights/latest`, `POST /leases`, and one submission of
the leased group (`group_size` rollouts of `rollout_tokens` model tokens, each ending in EOS, with
log-probs and policy versions) through `CoordinatorClient`. Nothing is generated: token ids are
drawn at random inside the vocabulary, so every submission passes the coordinator's checks and only
the coordinator's own work is timed. Each call's latency is recorded with its route and start time.
"""

from __future__ import annotations

import random
import threading
import time

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from decentrl.client import CoordinatorClient, RequestRejected
from decentrl.protocol import LeaseRequest, RegisterRequest, Rollout, RolloutSubmission
from decentrl.trust.identity import Signer


def make_rollouts(lease, info, rollout_tokens: int, rng: random.Random) -> RolloutSubmission:  # noqa: ANN001
    rollouts = []
    for task in lease.tasks:
        for slot in task.slots:
            token_ids = [rng.randrange(2, info["vocab_size"]) for _ in range(rollout_tokens - 1)]
            token_ids.append(info["eos_token_id"])
            segment = {
                "source": "model",
                "token_ids": token_ids,
                "logprobs": [-rng.random() * 3 for _ in token_ids],
                "policy_versions": [0] * len(token_ids),
            }
            rollout = {
                "lease_id": lease.lease_id,
                "task_id": task.task_id,
                "slot": slot,
                "prompt_token_ids": task.prompt_token_ids,
                "segments": [segment],
                "sampling": lease.sampling.model_dump(),
                "finish_reason": "stop",
            }
            rollouts.append(Rollout.model_validate(rollout))
    return RolloutSubmission(rollouts=rollouts)


def worker_thread(settings: dict, index: int, start: float, records: list, errors: list) -> None:
    """Register, then lease/submit until `settings['until']`; records (route, started, seconds, n)."""
    url = settings["urls"][index % len(settings["urls"])]  # workers spread over the replicas
    client = CoordinatorClient(url, max_wait=60)
    client.signer = Signer(Ed25519PrivateKey.generate())
    request = RegisterRequest(name=f"load-{settings['process']}-{index}", public_key=client.signer.public_key)
    client.token = client.register(request, settings["enroll_token"]).token
    rng = random.Random(index)
    while time.time() < start:
        time.sleep(0.01)
    mode = settings["mode"]
    try:
        while time.time() < settings["until"]:
            try:
                cycle(client, settings, mode, rng, records)
            except RequestRejected as error:  # counted (a lease expired under load is a finding);
                errors.append(str(error))  # the worker goes on, as a real one re-leases
    finally:
        client.close()


def cycle(client: CoordinatorClient, settings: dict, mode: str, rng: random.Random, records: list) -> None:
    """One turn of a worker's loop (or of a service phase): the requests it sends, each timed."""
    began = time.time()
    if mode == "chunk":
        client.chunk(settings["chunk"])
        records.append(("weights_chunk", began, time.time() - began, 0))
        return
    client.latest_weights()
    records.append(("weights_latest", began, time.time() - began, 0))
    if mode == "poll":
        return
    began = time.time()
    lease = client.lease(LeaseRequest(policy_version=0, max_groups=1))
    records.append(("lease", began, time.time() - began, 0))
    if lease is None:
        time.sleep(0.05)
        return
    submission = make_rollouts(lease, settings["info"], settings["rollout_tokens"], rng)
    began = time.time()
    result = client.submit_rollouts(submission)
    records.append(("submit", began, time.time() - began, len(result.accepted)))


def load_main(settings: dict, results) -> None:  # noqa: ANN001 - a multiprocessing queue
    """Run `settings['threads']` workers in this process; put their records on `results`."""
    records: list = []
    errors: list = []
    start = settings["start"]
    threads = [
        threading.Thread(target=worker_thread, args=(settings, index, start, records, errors), daemon=True)
        for index in range(settings["first"], settings["first"] + settings["threads"])
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    results.put({"records": records, "errors": errors})
