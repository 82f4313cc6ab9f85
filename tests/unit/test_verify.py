"""Hermetic checks of the trust primitives: signatures, replay window, rate limit, plausibility and
repeated-completion tests."""

from __future__ import annotations

import itertools
import math
import random

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from decentrl.protocol import Rollout, SamplingParams, Segment
from decentrl.trust.identity import SIGNATURE_HEADER, Signer, signature_valid, signed_message
from decentrl.trust.logprob_tolerance import LogprobTolerance
from decentrl.trust.plausibility import (
    chi2_sf,
    legendre,
    look_alpha,
    looks_per_block,
    milestone,
    smooth_test,
)
from decentrl.trust.ratelimit import RateLimiter
from decentrl.trust.repeats import detector_step, log_evidence, start_alpha
from decentrl.trust.replay_guard import ReplayGuard


def test_signature_covers_method_path_body_and_key() -> None:
    signer = Signer(Ed25519PrivateKey.generate())
    headers = signer.headers("POST", "/v1/rollouts", b'{"a": 1}', now=100.0)
    timestamp, nonce = headers["X-Decentrl-Timestamp"], headers["X-Decentrl-Nonce"]
    message = signed_message("POST", "/v1/rollouts", timestamp, nonce, b'{"a": 1}')
    assert signature_valid(signer.public_key, headers[SIGNATURE_HEADER], message)
    for tampered in (
        signed_message("POST", "/v1/rollouts", timestamp, nonce, b'{"a": 2}'),
        signed_message("POST", "/v1/leases", timestamp, nonce, b'{"a": 1}'),
        signed_message("POST", "/v1/rollouts", "101.000", nonce, b'{"a": 1}'),
    ):
        assert not signature_valid(signer.public_key, headers[SIGNATURE_HEADER], tampered)
    other = Signer(Ed25519PrivateKey.generate())
    assert not signature_valid(other.public_key, headers[SIGNATURE_HEADER], message)
    assert not signature_valid(signer.public_key, "zz", message)


def test_replay_guard_window_nonce_and_durable_record() -> None:
    recorded: set[tuple[str, str]] = set()

    def remember(identity: str, nonce: str, expires: float) -> bool:
        fresh = (identity, nonce) not in recorded
        recorded.add((identity, nonce))
        return fresh

    guard = ReplayGuard(max_skew=60, remember=remember)
    assert guard.check("w", "1010.0", "n" * 16, now=1010.0, durable=True) is None
    assert guard.check("w", "1010.0", "n" * 16, now=1011.0).reason == "replay"
    assert guard.check("other", "1010.0", "n" * 16, now=1011.0) is None  # nonces are per worker
    skewed = guard.check("w", "900.0", "m" * 16, now=1010.0)
    assert skewed.reason == "clock_skew" and "1010.000" in skewed.detail  # the server's time, to correct
    assert guard.check("w", "nan-ish", "m" * 16, now=1010.0).reason == "bad_signature"
    assert guard.check("w", "1200.0", "k" * 16, now=1200.0) is None  # old nonces were forgotten
    restarted = ReplayGuard(max_skew=60, remember=remember)  # a new process: memory is empty
    assert restarted.check("w", "1010.0", "n" * 16, now=1012.0, durable=True).reason == "replay"
    assert restarted.check("w", "1005.0", "q" * 16, now=1012.0, durable=True) is None  # no start bound


def test_rate_limiter_burst_then_rate() -> None:
    limiter = RateLimiter(rate=10, burst=5)
    assert [limiter.allow("a", 0.0) for _ in range(6)] == [True] * 5 + [False]
    assert limiter.exhausted("a", 0.0) and not limiter.exhausted("b", 0.0)
    assert limiter.allow("a", 0.1) and not limiter.allow("a", 0.1)  # 0.1 s at 10/s = one more
    # a request that read the clock earlier but arrives later refills nothing twice
    assert not limiter.allow("a", 0.0) and not limiter.allow("a", 0.1)


def test_legendre_basis_is_orthonormal_under_uniform() -> None:
    grid = [(i + 0.5) / 20000 for i in range(20000)]
    values = [legendre(u) for u in grid]
    for j in range(4):
        assert abs(sum(v[j] for v in values) / len(grid)) < 1e-6
        for k in range(4):
            second = sum(v[j] * v[k] for v in values) / len(grid)
            assert abs(second - (j == k)) < 1e-3


def test_chi2_survival_function() -> None:
    assert math.isclose(chi2_sf(2.0, 2), math.exp(-1.0))
    assert math.isclose(chi2_sf(9.487729, 4), 0.05, rel_tol=1e-5)  # table value


def test_alpha_spending_sums_below_alpha() -> None:
    looks = looks_per_block(32, 512)
    assert looks == 5 and [milestone(n, 32) for n in (31, 32, 63, 64, 512)] == [-1, 0, 0, 1, 4]
    total = sum(look_alpha(0.01, block, looks) * looks for block in range(1, 100_000))
    assert total < 0.01


def _worker_life(rng: random.Random, sample_u, blocks: int = 3) -> bool:
    """True when a worker whose PIT values come from `sample_u` is ever rejected over `blocks` blocks."""
    for block in range(1, blocks + 1):
        sums, tokens = [0.0] * 4, 0
        threshold = look_alpha(0.005, block, looks_per_block(32, 512))
        while tokens < 512:
            added = rng.randint(10, 40)
            before = tokens
            for _ in range(added):
                sums = [s + v for s, v in zip(sums, legendre(sample_u(rng)), strict=True)]
            tokens += added
            if milestone(tokens, 32) > milestone(before, 32) and smooth_test(sums, tokens, threshold).reject:
                return True
    return False


def test_plausibility_calibrated_on_uniform_and_powerful_on_shifted() -> None:
    rng = random.Random(0)
    honest = sum(_worker_life(rng, lambda r: r.random()) for _ in range(300))
    assert honest <= 3  # alpha = 0.005: expected < 1.5 of 300
    shifted = sum(_worker_life(rng, lambda r: r.random() ** 0.6, blocks=1) for _ in range(50))
    assert shifted >= 48  # tokens more probable than samples should be


# A toy policy over whole completions: completion c is tokens [c, c + 1] with these probabilities.
POLICY = [0.5, 0.3, 0.15, 0.05]


def _rollout(completion: int, slot: int, claimed_shift: float = 0.0, temperature: float = 1.0) -> Rollout:
    half = math.log(POLICY[completion]) / 2 + claimed_shift / 2  # split over two tokens
    segment = Segment(source="model", token_ids=[completion, completion + 1], logprobs=[half, half])
    sampling = SamplingParams(temperature=temperature, max_new_tokens=4)
    return Rollout(
        lease_id="l",
        task_id="t",
        slot=slot,
        prompt_token_ids=[1],
        segments=[segment],
        sampling=sampling,
        finish_reason="stop",
    )


def test_repeat_evidence_is_an_e_value_for_independent_samples() -> None:
    """Exact expectation over every group of 3 independent samples: 1 with honest claims, < 1 when the
    claims are low by less than the tolerance (the bound p_hi covers them)."""
    for shift, tolerance, expected in (
        (0.0, None, 1.0),
        (-0.01, LogprobTolerance(mean=0.01, max=0.01), None),
    ):
        total = 0.0
        for completions in itertools.product(range(len(POLICY)), repeat=3):
            probability = math.prod(POLICY[c] for c in completions)
            group = [_rollout(c, slot, shift) for slot, c in enumerate(completions)]
            total += probability * math.exp(log_evidence(group, tolerance, bet=0.5, references={}))
        if expected is None:
            assert total < 1.0
        else:
            assert math.isclose(total, expected, rel_tol=1e-12)


def test_repeat_evidence_of_copies_and_greedy_groups() -> None:
    copies = [_rollout(1, slot) for slot in range(8)]  # p = 0.3, copied into all 8 slots
    assert math.isclose(log_evidence(copies, None, 0.5, {}), 7 * math.log(0.5 + 0.5 / 0.3))
    distinct = [_rollout(c, slot) for slot, c in enumerate([0, 1, 2, 3])]
    assert math.isclose(log_evidence(distinct, None, 0.5, {}), 3 * math.log(0.5))
    greedy = [_rollout(1, slot, temperature=0.0) for slot in range(8)]
    assert log_evidence(greedy, None, 0.5, {}) == 0.0  # greedy decoding repeats itself by definition


def test_repeat_evidence_accumulates_across_submissions() -> None:
    """One rollout per submission earns the same evidence as all of them in one submission: the
    group's reference is the first slot the worker ever sent for it."""
    copies = [_rollout(1, slot) for slot in range(8)]
    references: dict[str, str] = {}
    one_by_one = sum(log_evidence([rollout], None, 0.5, references) for rollout in copies)
    assert math.isclose(one_by_one, 7 * math.log(0.5 + 0.5 / 0.3))
    assert list(references) == [copies[0].task_id]


_SLOTS = {
    (group, slot, c): _rollout(c, slot).model_copy(update={"task_id": f"t{group}"})
    for group in range(2)
    for slot in range(8)
    for c in range(len(POLICY))
}


def _first_alarm(
    rng: random.Random, submissions: int, copy_from: int | None, alpha: float = 0.005
) -> int | None:
    """Submission (1-based) at which a worker's detector fires: 2 groups of 8 slots per submission,
    independent samples of POLICY, or copies of one sample from submission `copy_from` on."""
    detector = None
    for submission in range(1, submissions + 1):
        rollouts = []
        for group in range(2):
            if copy_from is not None and submission >= copy_from:
                picks = [rng.choices(range(4), POLICY)[0]] * 8
            else:
                picks = rng.choices(range(4), POLICY, k=8)
            rollouts += [_SLOTS[group, slot, c] for slot, c in enumerate(picks)]
        detector = detector_step(
            detector, alpha, submission, log_evidence(rollouts, None, 0.5, {})
        )  # new groups each time
        if detector >= 0:
            return submission
    return None


def test_repeat_detector_spends_alpha_and_catches_a_turncoat() -> None:
    assert sum(start_alpha(0.01, s) for s in range(1, 100_000)) < 0.01
    rng = random.Random(0)
    honest = sum(_first_alarm(rng, 50, None, alpha=0.05) is not None for _ in range(200))
    assert honest <= 10 * 2  # lifetime bound alpha = 0.05: at most ~10 of 200 (x2 for chance)
    # copies from submission 301 on: the threshold there is log(301 * 302 / alpha) = 16.7 nats, and
    # even copies of the likeliest completion (p = 0.5) earn 14 log(1.5) = 5.7 nats a submission
    for _ in range(20):
        alarm = _first_alarm(rng, 310, copy_from=301)
        assert alarm is not None and 301 <= alarm <= 303
