"""One optimizer step of the policy update, with the algorithm the config chose.

The story of a step: one forward pass gives log pi_theta (with gradient) and the entropy; its
detached copy is pi_prox (decentrl takes one optimizer step per batch, so the proximal policy is
the current model and a second no-grad pass would give the same numbers at 1.5x the compute);
the off-policy correction turns pi_prox and the workers' mu into an anchor and per-token weights;
the policy loss aggregates over the global batch; optional KL-to-reference and entropy terms are
added; then clip the gradient norm and step AdamW.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from decentrl.algo.advantages import AdvantageEstimator
from decentrl.algo.aggregation import BatchCounts, token_scale
from decentrl.algo.config import AlgorithmConfig
from decentrl.algo.corrections import OffPolicyCorrection, mismatch_kl
from decentrl.algo.kl import kl_per_token
from decentrl.algo.logprobs import sequence_logprobs
from decentrl.algo.losses import LossInputs, PolicyLoss
from decentrl.algo.registry import build_advantage, build_correction, build_loss
from decentrl.config import TrainerConfig
from decentrl.trainer.batch import TrainTensors


@dataclass
class Algorithm:
    """The configured variants, built once per trainer."""

    config: AlgorithmConfig
    advantage: AdvantageEstimator
    loss: PolicyLoss
    correction: OffPolicyCorrection

    @classmethod
    def from_config(cls, config: AlgorithmConfig) -> Algorithm:
        return cls(
            config,
            build_advantage(config.advantage),
            build_loss(config.loss),
            build_correction(config.correction),
        )


def learning_rate(config: TrainerConfig, policy_version: int) -> float:
    """The schedule as a pure function of the version, so a resumed trainer needs no scheduler state."""
    if policy_version < config.lr_warmup_steps:
        return config.lr * (policy_version + 1) / config.lr_warmup_steps
    if config.lr_decay == "constant":
        return config.lr
    span = max(1, config.num_steps - config.lr_warmup_steps)
    progress = min(1.0, (policy_version - config.lr_warmup_steps) / span)
    return config.lr * (
        config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    )


def policy_loss(
    model: torch.nn.Module,
    batch: TrainTensors,
    algorithm: Algorithm,
    temperature: float,
    counts: BatchCounts,
    reference_model: torch.nn.Module | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The differentiable loss of `batch` (one micro-batch of a global batch with `counts`)."""
    config = algorithm.config
    mask = batch.loss_mask_bt
    logprobs_bt, entropy_bt = sequence_logprobs(
        model,
        batch.input_ids_bt,
        batch.attention_mask_bt,
        temperature,
        with_entropy=True,
        entropy_grad=config.entropy_coef > 0,
    )
    proximal_bt = logprobs_bt.detach()
    correction = algorithm.correction(proximal_bt, batch.behaviour_logprobs_bt, mask)
    scale_bt = token_scale(config.aggregation, mask, counts)
    output = algorithm.loss(
        LossInputs(
            logprobs_bt=logprobs_bt,
            anchor_logprobs_bt=correction.anchor_logprobs_bt,
            weights_bt=correction.weights_bt,
            advantages_bt=batch.advantages_bt,
            loss_mask_bt=mask,
            token_scale_bt=scale_bt,
        )
    )
    loss = output.loss
    stats = {"policy_loss": float(output.loss.detach()), **output.stats, **correction.stats}
    if config.kl_coef > 0:
        assert reference_model is not None, "kl_coef > 0 needs the reference model"
        with torch.no_grad():
            reference_bt, _ = sequence_logprobs(
                reference_model, batch.input_ids_bt, batch.attention_mask_bt, temperature
            )
        # Off-policy tokens carry the correction's weight on the KL term too (TRL's
        # use_bias_correction_kl, after DeepSeek-V3.2).
        kl_bt = kl_per_token(logprobs_bt, reference_bt, config.kl_estimator) * correction.weights_bt
        kl = (kl_bt * scale_bt).sum()
        loss = loss + config.kl_coef * kl
        stats["kl_reference"] = float(kl.detach())
    if config.entropy_coef > 0:
        loss = loss - config.entropy_coef * (entropy_bt * scale_bt).sum()
    stats["entropy"] = float(entropy_bt.detach()[mask].mean()) if bool(mask.any()) else 0.0
    stats["mismatch_kl"] = mismatch_kl(proximal_bt, batch.behaviour_logprobs_bt, mask)
    return loss, stats


def staleness_stats(batch: TrainTensors, policy_version: int) -> dict[str, float]:
    """Token staleness (trainer version - sampling version) of the loss tokens: mean, max, and the
    fraction of tokens at each staleness 0..8 plus 'more' (the per-step histogram on /metrics)."""
    staleness = (policy_version - batch.policy_versions_bt[batch.loss_mask_bt]).float()
    if staleness.numel() == 0:
        return {}
    stats = {"staleness_mean": float(staleness.mean()), "staleness_max": float(staleness.max())}
    for value in range(9):
        stats[f"staleness_frac_{value}"] = float((staleness == value).float().mean())
    stats["staleness_frac_more"] = float((staleness > 8).float().mean())
    return stats


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainTensors,
    algorithm: Algorithm,
    config: TrainerConfig,
    temperature: float,
    policy_version: int,
    max_new_tokens: int,
    reference_model: torch.nn.Module | None = None,
) -> dict[str, float]:
    """Update `model` on `batch` (trainer at `policy_version`); returns the step's diagnostics."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(config, policy_version)
    model.train()
    counts = BatchCounts(
        num_loss_tokens=batch.num_loss_tokens,
        num_sequences=batch.input_ids_bt.shape[0],
        max_new_tokens=max_new_tokens,
    )
    loss, stats = policy_loss(model, batch, algorithm, temperature, counts, reference_model)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
    optimizer.step()
    model.eval()
    return {
        "loss": float(loss.detach()),
        "lr": optimizer.param_groups[0]["lr"],
        "reward_mean": float(batch.rewards_b.mean()),
        "grad_norm": float(grad_norm),
        "num_loss_tokens": float(batch.num_loss_tokens),
        "num_rollouts": float(batch.rewards_b.numel()),
        **stats,
        **staleness_stats(batch, policy_version),
    }
