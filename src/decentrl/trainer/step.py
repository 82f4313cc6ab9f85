"""One optimizer step of the decoupled-PPO policy update."""

from __future__ import annotations

import math

import torch

from decentrl.algo.logprobs import sequence_logprobs
from decentrl.algo.losses import decoupled_ppo_loss
from decentrl.config import TrainerConfig
from decentrl.trainer.batch import TrainTensors


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


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainTensors,
    config: TrainerConfig,
    temperature: float,
    policy_version: int,
) -> dict[str, float]:
    """Update `model` on `batch` (trainer at `policy_version`); returns the step's diagnostics."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(config, policy_version)
    model.train()
    logprobs_bt, entropy_bt = sequence_logprobs(
        model, batch.input_ids_bt, batch.attention_mask_bt, temperature, with_entropy=True
    )
    # One optimizer step per batch, so the proximal policy (trainer weights at step start) is the
    # current model: its log-probs are this forward pass, detached. A second no-grad pass would
    # give the same numbers at 1.5x the compute.
    proximal_bt = logprobs_bt.detach()
    output = decoupled_ppo_loss(
        logprobs_bt,
        proximal_bt,
        batch.behaviour_logprobs_bt,
        batch.advantages_bt,
        batch.loss_mask_bt,
        num_loss_tokens=max(1, batch.num_loss_tokens),
        clip_eps=config.clip_eps,
        is_cap=config.is_cap,
    )
    optimizer.zero_grad(set_to_none=True)
    output.loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
    optimizer.step()
    model.eval()
    mask = batch.loss_mask_bt
    staleness = (policy_version - batch.policy_versions_bt[mask]).float()
    return {
        "loss": float(output.loss.detach()),
        "lr": optimizer.param_groups[0]["lr"],
        "reward_mean": float(batch.rewards_b.mean()),
        "entropy": float(entropy_bt[mask].mean()),
        "grad_norm": float(grad_norm),
        "staleness_mean": float(staleness.mean()),
        "staleness_max": float(staleness.max()),
        "num_loss_tokens": float(batch.num_loss_tokens),
        "num_rollouts": float(batch.rewards_b.numel()),
        **output.stats,
    }
