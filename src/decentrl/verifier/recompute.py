"""What a trusted verifier measures on one rollout under the policy version its tokens claim.

One forward pass over prompt + segments gives, for every model token: the recomputed log-prob
(with `logprobs_from_logits`, the same function the engines and the trainer use) to compare with
the claimed one (the largest error, and the mean test's evidence under the tolerance of the
worker's engine class, `trust/logprob_tolerance.py`), and the randomised PIT value u (see
`plausibility.py`) whose Legendre sums feed the sampling-plausibility test. Env tokens are context only. Temperature 0 (greedy) has no sampling
distribution to test, so such rollouts report log-prob errors only. `compare_previous` recomputes
the same tokens under the version before the claimed one, for the version test
(`version_check.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from decentrl.algo.logprobs import logprobs_from_logits
from decentrl.model.vision import move_vision
from decentrl.protocol import VerifyJob
from decentrl.trust.plausibility import MAX_ORDER
from decentrl.trust.token_evidence import pit_sums, token_errors
from decentrl.verifier.version_check import version_log_evidence


@dataclass
class Measurement:
    """Accumulated over the versions a rollout's tokens claim (today: one)."""

    num_tokens: int = 0
    """Sampled (temperature > 0) tokens in `pit_sums`."""
    logprob_tokens: int = 0
    """Model tokens whose log-prob was compared (greedy ones too)."""
    max_logprob_error: float = 0.0
    logprob_error_sum: float = 0.0
    """Sum over the compared tokens of |claimed - recomputed| (with `logprob_tokens`: their mean)."""
    error_log_evidence: float = 0.0
    """The mean test's log-evidence from these tokens (`LogprobTolerance.token_log_evidence`)."""
    pit_sums: list[float] = field(default_factory=lambda: [0.0] * MAX_ORDER)
    version_tokens: int = 0
    """Model tokens also recomputed under the version before the one they claim."""
    version_log_evidence: float = 0.0
    """The version test's log-evidence from those tokens (`version_check.version_log_evidence`)."""

    @property
    def mean_logprob_error(self) -> float:
        return self.logprob_error_sum / self.logprob_tokens if self.logprob_tokens else 0.0


def _row(job: VerifyJob) -> tuple[list[int], list[float], list[int]]:
    """Token ids, claimed log-probs (nan for context) and claimed versions (-1 for context)."""
    ids, claimed, versions = list(job.prompt_token_ids), [], []
    claimed += [float("nan")] * len(ids)
    versions += [-1] * len(ids)
    for segment in job.segments:
        ids += segment.token_ids
        if segment.source == "model":  # the coordinator accepts none without both lists
            assert segment.logprobs is not None and segment.policy_versions is not None
            claimed += segment.logprobs
            versions += segment.policy_versions
        else:
            claimed += [float("nan")] * len(segment.token_ids)
            versions += [-1] * len(segment.token_ids)
    return ids, claimed, versions


@dataclass
class Compared:
    """The tokens one `measure` call compared: what `compare_previous` needs to redo it."""

    jobs: list[VerifyJob]
    ids_bt: torch.Tensor
    mask_bt: torch.Tensor
    owner_n: torch.Tensor
    """Index in `jobs` of each compared token."""
    position_n: torch.Tensor
    temperature_n: torch.Tensor
    claimed_n: torch.Tensor
    recomputed_n: torch.Tensor
    """Under the claimed version (float64)."""
    mean_n: torch.Tensor
    """The mean tolerance of each token's worker (float64)."""
    vision: Mapping[str, torch.Tensor] | None = None
    """A vision-language policy's pixel inputs of the rows' images."""


def _recompute(
    model: torch.nn.Module,
    ids_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    owner_n: torch.Tensor,
    position_n: torch.Tensor,
    temperature_n: torch.Tensor,
    vision: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward pass over the rows (with their images' pixels, for a vision-language policy):
    the checked positions' logits (fp32, CPU) and log-probs (float64)."""
    parameter = next(model.parameters())
    device = parameter.device
    pixels = move_vision(dict(vision or {}), device, parameter.dtype)
    logits_btv = model(
        input_ids=ids_bt.to(device), attention_mask=mask_bt.to(device), use_cache=False, **pixels
    ).logits
    # The checked positions only, in fp32 on CPU (whatever the model's device and dtype).
    logits_nv = logits_btv[owner_n.to(device), position_n.to(device) - 1].float().cpu()
    tokens_n = ids_bt[owner_n, position_n]
    recomputed_n = torch.empty(len(owner_n), dtype=torch.float64)
    for temperature in set(temperature_n.tolist()):
        picked = temperature_n == temperature
        recomputed_n[picked] = logprobs_from_logits(logits_nv[picked], tokens_n[picked], temperature).double()
    return logits_nv, recomputed_n


@torch.no_grad()
def compare_previous(model: torch.nn.Module, compared: Compared, results: dict[str, Measurement]) -> None:
    """Recompute `compared`'s tokens under the model's version (the one before theirs) and add the
    version test's evidence to `results`."""
    c = compared
    _, previous_n = _recompute(model, c.ids_bt, c.mask_bt, c.owner_n, c.position_n, c.temperature_n, c.vision)
    evidence_n = version_log_evidence(compared.claimed_n, compared.recomputed_n, previous_n, compared.mean_n)
    jobs, owner_n = compared.jobs, compared.owner_n
    evidence_j = torch.zeros(len(jobs), dtype=torch.float64).index_add_(0, owner_n, evidence_n)
    counts_j = torch.zeros(len(jobs), dtype=torch.long).index_add_(0, owner_n, torch.ones_like(owner_n))
    for index in set(owner_n.tolist()):
        result = results[jobs[index].rollout_id]
        result.version_log_evidence += float(evidence_j[index])
        result.version_tokens += int(counts_j[index])


@torch.no_grad()
def measure(
    model: torch.nn.Module,
    jobs: list[VerifyJob],
    version: int,
    results: dict[str, Measurement],
    vision: Mapping[str, torch.Tensor] | None = None,
) -> Compared | None:
    """Check the tokens of `jobs` that claim `version` (the model must hold it); adds to `results`
    and returns what it compared (None: no token claims `version`). `vision`: the pixel inputs
    of the jobs' images, job after job (a vision-language policy).

    One forward pass for all of them, then every claimed token at once (per-token Python work is
    what dominates a small model's verification otherwise)."""
    rows = [_row(job) for job in jobs]
    width = max(len(ids) for ids, _, _ in rows)
    ids_bt = torch.zeros((len(rows), width), dtype=torch.long)
    mask_bt = torch.zeros((len(rows), width), dtype=torch.long)
    owner, position, claimed = [], [], []
    for index, (ids, claimed_row, versions) in enumerate(rows):
        ids_bt[index, : len(ids)] = torch.tensor(ids)
        mask_bt[index, : len(ids)] = 1
        for t in range(1, len(ids)):
            if versions[t] == version:
                owner.append(index)
                position.append(t)
                claimed.append(claimed_row[t])
    if not owner:
        return None
    owner_n, position_n = torch.tensor(owner), torch.tensor(position)
    temperature_n = torch.tensor([job.temperature for job in jobs], dtype=torch.float64)[owner_n]
    # the mean test's null per token: the tolerance of the worker's engine class
    mean_n = torch.tensor([job.tolerance_mean for job in jobs], dtype=torch.float64)[owner_n]
    claimed_n = torch.tensor(claimed, dtype=torch.float64)
    logits_nv, recomputed_n = _recompute(model, ids_bt, mask_bt, owner_n, position_n, temperature_n, vision)
    tokens_n = ids_bt[owner_n, position_n]
    error_n, evidence_n = token_errors(recomputed_n, claimed_n, mean_n)
    error_j = torch.zeros(len(jobs), dtype=torch.float64)
    error_j.scatter_reduce_(0, owner_n, error_n, reduce="amax")
    error_sum_j = torch.zeros(len(jobs), dtype=torch.float64).index_add_(0, owner_n, error_n)
    evidence_j = torch.zeros(len(jobs), dtype=torch.float64).index_add_(0, owner_n, evidence_n)
    compared_j = torch.zeros(len(jobs), dtype=torch.long).index_add_(0, owner_n, torch.ones_like(owner_n))
    seed = sum(job.pit_seed for job in jobs) % (1 << 62)
    sums_jk, counts_j = pit_sums(logits_nv, tokens_n, temperature_n, owner_n, len(jobs), seed)
    present = set(owner)
    for index, job in enumerate(jobs):
        if index not in present:
            continue
        result = results.setdefault(job.rollout_id, Measurement())
        result.max_logprob_error = max(result.max_logprob_error, float(error_j[index]))
        result.logprob_error_sum += float(error_sum_j[index])
        result.error_log_evidence += float(evidence_j[index])
        result.logprob_tokens += int(compared_j[index])
        if counts_j[index] > 0:
            result.pit_sums = [a + b for a, b in zip(result.pit_sums, sums_jk[index].tolist(), strict=True)]
            result.num_tokens += int(counts_j[index])
    return Compared(
        jobs, ids_bt, mask_bt, owner_n, position_n, temperature_n, claimed_n, recomputed_n, mean_n, vision
    )
