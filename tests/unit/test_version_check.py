"""The version test: do a rollout's claimed log-probs fit the version before the claimed one better?"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from decentrl.config import ModelConfig
from decentrl.engines.hf import HFEngine
from decentrl.model.tiny import build_tiny
from decentrl.protocol import SamplingParams, Segment, VerifyJob
from decentrl.trust.repeats import detector_step
from decentrl.verifier.recompute import Measurement, compare_previous, measure
from decentrl.verifier.version_check import BET, FLOOR, version_log_evidence


def _evidence(claimed: float, recomputed: float, previous: float, mean: float = 0.03) -> float:
    values = [torch.tensor([value], dtype=torch.float64) for value in (claimed, recomputed, previous, mean)]
    return float(version_log_evidence(*values)[0])


def test_version_evidence_by_hand() -> None:
    assert (BET, FLOOR) == (0.7, 0.1)
    # the previous version explains the claim exactly: s = 0.2 - 0 = |delta| -> x = 1
    assert _evidence(-1.0, -1.2, -1.0) == pytest.approx(math.log(1.7))
    # the claimed version does: x = -1
    assert _evidence(-1.2, -1.2, -1.0) == pytest.approx(math.log(0.3))
    # half-way: s = 0.1 - 0.1 = 0, no evidence either way
    assert _evidence(-1.1, -1.2, -1.0) == pytest.approx(0.0)
    # a 2-nat outlier beside the claimed version still scores as the claimed version's (|s| <= |delta|)
    assert _evidence(-3.2, -1.2, -1.0) == pytest.approx(math.log(0.3))
    # versions 0.001 apart, below the floor 0.1 x 0.03: s = 0.1 - 0.101 = -0.001, x = -0.001 / 0.003
    assert _evidence(-0.9, -1.0, -1.001) == pytest.approx(math.log(1 - 0.7 / 3))
    # the floor follows the class: under float32's mean 0.002 the floor is 0.0002, so x = -1
    assert _evidence(-0.9, -1.0, -1.001, mean=0.002) == pytest.approx(math.log(0.3))


def test_symmetric_noise_is_a_fair_bet_and_an_older_sampler_is_not() -> None:
    """Engine noise that does not know which way the version moved keeps E[factor] <= 1 (an
    e-value), even when it is as large as the version gap; a claim the older version explains grows
    (when the noise is below the gap: bf16's mean error on the demo model is 0.009 nats)."""
    generator = torch.Generator().manual_seed(0)
    size = 200_000
    delta_n = 0.04 * torch.randn(size, generator=generator, dtype=torch.float64)
    mean_n = torch.full((size,), 0.03, dtype=torch.float64)
    recomputed_n = -1.0 + torch.zeros(size, dtype=torch.float64)
    previous_n = recomputed_n - delta_n
    growth = {}
    for scale in (0.01, 0.04):
        noise_n = scale * torch.randn(size, generator=generator, dtype=torch.float64)
        honest_n = version_log_evidence(recomputed_n + noise_n, recomputed_n, previous_n, mean_n)
        assert float(honest_n.exp().mean()) < 0.9
        growth[scale] = float(
            version_log_evidence(previous_n + noise_n, recomputed_n, previous_n, mean_n).mean()
        )
    assert growth[0.01] > 0.25 and abs(growth[0.04]) < 0.05  # noise the gap's size: no power


@pytest.fixture(scope="module")
def two_versions():
    """A tiny confident model (version 1) and the version before it (0), one perturbation apart."""
    torch.manual_seed(0)
    current, tokenizer = build_tiny(ModelConfig())
    with torch.no_grad():
        current.model.norm.weight.mul_(10.0)
    previous = copy.deepcopy(current)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for tensor in previous.parameters():
            tensor.add_(0.02 * tensor.std() * torch.randn(tensor.shape, generator=generator))
    return current.eval(), previous.eval(), tokenizer


def _jobs(sampler: torch.nn.Module, tokenizer, mean: float) -> list[VerifyJob]:
    """Rollouts sampled by `sampler` in fp32, every token claiming version 1."""
    engine = HFEngine(sampler, [tokenizer.eos_token_id], tokenizer.pad_token_id, "cpu")
    prompts = [tokenizer.encode(text) for text in ("12+3=", "4+56=", "7*8=", "90-1=")]
    completions = engine.generate(
        [p for p in prompts for _ in range(8)], SamplingParams(max_new_tokens=6), seed=2
    )
    return [
        VerifyJob(
            rollout_id=str(index),
            temperature=1.0,
            prompt_token_ids=prompts[index // 8],
            segments=[
                Segment(
                    source="model",
                    token_ids=completion.token_ids,
                    logprobs=completion.logprobs,
                    policy_versions=[1] * len(completion.token_ids),
                )
            ],
            pit_seed=index,
            tolerance_mean=mean,
        )
        for index, completion in enumerate(completions)
    ]


def _version_evidence(current, previous, jobs: list[VerifyJob]) -> tuple[float, int]:
    results: dict[str, Measurement] = {}
    compared = measure(current, jobs, 1, results)
    assert compared is not None
    compare_previous(previous, compared, results)
    return sum(m.version_log_evidence for m in results.values()), sum(
        m.version_tokens for m in results.values()
    )


def test_the_verifier_convicts_a_claim_sampled_with_the_version_before(two_versions) -> None:
    """Held to bf16's mean tolerance (0.03, where the version gap hides from the error tests), the
    claims sampled with version 0 cross the first verdict batch's threshold; honest ones sink."""
    current, previous, tokenizer = two_versions
    honest, tokens = _version_evidence(current, previous, _jobs(current, tokenizer, 0.03))
    assert tokens > 50 and honest < -10
    older, tokens = _version_evidence(current, previous, _jobs(previous, tokenizer, 0.03))
    assert tokens > 50 and older > 20
    assert detector_step(None, 0.001, 1, older) >= 0 > detector_step(None, 0.001, 1, honest)
