"""What a trusted verifier measures on one rollout under the policy version its tokens claim.

One forward pass over prompt + segments gives, for every model token: the recomputed log-prob
(with `logprobs_from_logits`, the same function the engines and the trainer use) to compare with
the claimed one, and the randomised PIT value u (see `plausibility.py`) whose Legendre sums feed the
sampling-plausibility test. Env tokens are context only. Temperature 0 (greedy) has no sampling
distribution to test, so such rollouts report log-prob errors only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from decentrl.algo.logprobs import logprobs_from_logits
from decentrl.protocol import VerifyJob
from decentrl.verify.plausibility import MAX_ORDER, legendre


@dataclass
class Measurement:
    """Accumulated over the versions a rollout's tokens claim (today: one)."""

    num_tokens: int = 0
    max_logprob_error: float = 0.0
    pit_sums: list[float] = field(default_factory=lambda: [0.0] * MAX_ORDER)


def _row(job: VerifyJob) -> tuple[list[int], list[float], list[int]]:
    """Token ids, claimed log-probs (nan for context) and claimed versions (-1 for context)."""
    ids, claimed, versions = list(job.prompt_token_ids), [], []
    claimed += [float("nan")] * len(ids)
    versions += [-1] * len(ids)
    for segment in job.segments:
        ids += segment.token_ids
        if segment.source == "model":
            claimed += segment.logprobs
            versions += segment.policy_versions
        else:
            claimed += [float("nan")] * len(segment.token_ids)
            versions += [-1] * len(segment.token_ids)
    return ids, claimed, versions


@torch.no_grad()
def measure(
    model: torch.nn.Module, jobs: list[VerifyJob], version: int, results: dict[str, Measurement]
) -> None:
    """Check the tokens of `jobs` that claim `version` (the model must hold it); adds to `results`."""
    rows = [_row(job) for job in jobs]
    width = max(len(ids) for ids, _, _ in rows)
    ids_bt = torch.zeros((len(rows), width), dtype=torch.long)
    mask_bt = torch.zeros((len(rows), width), dtype=torch.long)
    for index, (ids, _, _) in enumerate(rows):
        ids_bt[index, : len(ids)] = torch.tensor(ids)
        mask_bt[index, : len(ids)] = 1
    logits_btv = model(input_ids=ids_bt, attention_mask=mask_bt).logits[:, :-1].float()
    for index, (job, (ids, claimed, versions)) in enumerate(zip(jobs, rows, strict=True)):
        positions = [t for t in range(1, len(ids)) if versions[t] == version]
        if not positions:
            continue
        logits_tv = logits_btv[index, [t - 1 for t in positions]]
        tokens_t = torch.tensor([ids[t] for t in positions])
        recomputed_t = logprobs_from_logits(logits_tv, tokens_t, job.temperature).double()
        claimed_t = torch.tensor([claimed[t] for t in positions], dtype=torch.float64)
        result = results.setdefault(job.rollout_id, Measurement())
        error = float((recomputed_t - claimed_t).abs().max())
        result.max_logprob_error = max(result.max_logprob_error, error)
        if job.temperature > 0:
            _add_pit(result, logits_tv, tokens_t, job)


def _add_pit(result: Measurement, logits_tv: torch.Tensor, tokens_t: torch.Tensor, job: VerifyJob) -> None:
    """Randomised PIT u = P(more probable tokens) + V * p(token), V from the job's secret seed."""
    probs_tv = torch.softmax(logits_tv.double() / job.temperature, dim=-1)
    chosen_t = probs_tv.gather(-1, tokens_t[:, None]).squeeze(-1)
    above_t = (probs_tv * (probs_tv > chosen_t[:, None])).sum(-1)
    generator = torch.Generator().manual_seed(job.pit_seed + result.num_tokens)
    jitter_t = torch.rand(len(tokens_t), generator=generator, dtype=torch.float64)
    u_t = (above_t + jitter_t * chosen_t).clamp(0.0, 1.0)
    for u in u_t.tolist():
        result.pit_sums = [total + value for total, value in zip(result.pit_sums, legendre(u), strict=True)]
    result.num_tokens += len(tokens_t)
