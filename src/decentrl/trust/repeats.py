"""Repeated completions: are the slots of a group really independent samples of the policy?

The slots of a group are independent draws from the policy at the leased temperature (no top-p or
top-k: the lease fixes only the temperature), so the chance that slot k repeats slot r's completion
exactly is p(y_r), the probability of that token sequence, which is exp(sum of its claimed
log-probs). The claimed log-probs are those sampling probabilities (a sampled fraction is recomputed
by the verifier and must agree within the worker's tolerance, `logprob_tolerance.py`). A worker that writes its completions
(the reference answer pasted into every slot) or samples once and copies the result repeats itself
far more often than that, even when every token's log-prob is honestly computed; the per-token
plausibility test (`plausibility.py`) hardly sees it when the written answer is one the model
finds likely, because each copy taken alone looks like a sample.

Testing by betting (Shafer 2021, "Testing by betting"; Waudby-Smith & Ramdas 2024): every later slot
k of a group in one submission multiplies the evidence by

    e_k = 1 - bet + bet * 1{y_k = y_r} / p_hi(y_k),   p_hi = min(1, exp(sum logprob + tol * n))

with r the reference slot of the group: the first slot of it this worker ever submitted (the
evidence accumulates across its submissions, so sending one rollout per request changes nothing),
and p_hi an upper bound of the true probability
when the claimed log-probs are within tolerance (tol: the mean error per token the worker's engine
class is allowed, `logprob_tolerance.py`; the verifier's mean test holds the claims to it). Given everything before slot k, an honest worker's
e_k has mean <= 1, so the product over any run of its groups is a test supermartingale and exceeds
1/a with probability <= a (Ville's inequality). A change detector needs products that start at any
submission s: start s gets a_s = alpha / (s (s + 1)) (the a_s sum to alpha), and the worker is
quarantined when some start's product exceeds 1 / a_s. That is one number per worker, updated by
the recursion D_s = max(D_{s-1}, log a_s) + log E_s (E_s: the product of submission s), with
quarantine at D_s >= 0: a CUSUM over e-values (Shin, Ramdas & Rinaldo 2022, "E-detectors") whose
lifetime false-alarm probability for an honest worker stays below alpha however long it runs, and
which judges a worker that turns hostile on what it sends after the change.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from collections.abc import Sequence

from decentrl.protocol import Rollout
from decentrl.trust.logprob_tolerance import LogprobTolerance


def completion_digest(rollout: Rollout) -> str:
    """sha256 of a rollout's completion (its segments' sources and token ids)."""
    completion = [(segment.source, segment.token_ids) for segment in rollout.segments]
    return hashlib.sha256(json.dumps(completion).encode()).hexdigest()


def _log_probability_bound(rollout: Rollout, tolerance: LogprobTolerance | None) -> float:
    """log p_hi: the claimed log-probability of the whole completion, raised by n times the mean
    error per token the worker's tolerance allows."""
    total, count = 0.0, 0
    for segment in rollout.segments:
        if segment.source == "model":
            total += sum(segment.logprobs or [])
            count += len(segment.token_ids)
    slack = 0.0 if tolerance is None else count * tolerance.mean
    return min(0.0, total + slack)


def log_evidence(
    rollouts: Sequence[Rollout], tolerance: LogprobTolerance | None, bet: float, references: dict[str, str]
) -> float:
    """log of the product of the e_k of one submission's rollouts (0 when nothing can be tested).
    `tolerance`: the worker's log-prob tolerance (None: claims taken as exact).

    `references` maps a task to the completion digest of the worker's reference slot for it; a task
    without one takes its lowest slot here as the reference, and is added to `references`."""
    assert 0.0 < bet < 1.0, "the bet must leave the evidence positive after a non-repeat"
    groups: dict[str, list[Rollout]] = defaultdict(list)
    for rollout in rollouts:
        if rollout.sampling.temperature > 0:  # greedy decoding repeats itself by definition
            groups[rollout.task_id].append(rollout)
    total = 0.0
    for task_id, members in groups.items():
        members.sort(key=lambda rollout: rollout.slot)
        if task_id not in references:
            references[task_id] = completion_digest(members.pop(0))
        for rollout in members:
            if completion_digest(rollout) == references[task_id]:
                probability = math.exp(_log_probability_bound(rollout, tolerance))
                total += math.log(1.0 - bet + bet / max(probability, 1e-300))
            else:
                total += math.log(1.0 - bet)
    return total


def start_alpha(alpha: float, submission: int) -> float:
    """a_s of the product that starts at a worker's submission `submission` >= 1; they sum to alpha."""
    assert submission >= 1
    return alpha / (submission * (submission + 1))


def detector_step(previous: float | None, alpha: float, submission: int, log_e: float) -> float:
    """D_s from D_{s-1} (None before the first submission); the worker is caught at D_s >= 0."""
    floor = math.log(start_alpha(alpha, submission))
    return max(floor if previous is None else previous, floor) + log_e
