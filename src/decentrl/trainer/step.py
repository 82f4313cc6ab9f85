"""One version of the policy update: several optimizer steps on the mini-batches of one batch.

The story of a version (as in verl and AReaL):
1. `score`, then `apply_correction`: with no gradient, the policy at the start of the version scores every
   token once: that is pi_prox. The off-policy correction turns pi_prox and the workers' mu into
   the trust region's anchor and per-token weights, once for the whole batch (batch-global
   corrections such as M2PO see every token); a KL penalty's reference log-probs come here too.
2. `minibatch_update`, for each of `trainer.minibatches_per_version` mini-batches (and again
   for each further pass of `trainer.epochs`, against the same pi_prox): forward and
   backward over token-budgeted micro-batches (`trainer.micro_batch_tokens`), each loss already
   divided by the mini-batch's global counts so the gradients add up to the mini-batch's whole;
   then clip the gradient norm and step AdamW. From the second mini-batch on pi_theta has moved
   away from pi_prox, so the clip acts as a trust region.
The trainer publishes the version after the last mini-batch.

The same story runs on any number of ranks (`distributed.Ranks`; one process is the plain case,
where every collective is a no-op): every rank holds the whole collated batch (advantages and the
loss's denominators are global), scores pi_prox on its own rows, the rows are summed into the
whole batch's pi_prox on every rank and the correction sees every token; each mini-batch is then
split over the ranks, each rank's loss divided by the whole mini-batch's counts, FSDP2 sums the
gradients, and the metrics are summed over the ranks before they are averaged, so N ranks report
what one process would.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from decentrl.algo.advantages import AdvantageEstimator
from decentrl.algo.aggregation import BatchCounts, token_scale
from decentrl.algo.corrections import OffPolicyCorrection, mismatch_kl, rejection_stats, token_log_rho
from decentrl.algo.kl import sampled_kl_per_token
from decentrl.algo.logprobs import sequence_logprobs
from decentrl.algo.losses import LossInputs, PolicyLoss
from decentrl.algo.registry import build_advantage, build_correction, build_loss
from decentrl.config import TrainerConfig
from decentrl.config.algorithm import AlgorithmConfig
from decentrl.trainer import distributed
from decentrl.trainer.batch import TrainTensors, micro_batch_rows, version_schedule
from decentrl.trainer.distributed import Ranks
from decentrl.trainer.master_weights import MasterWeights

log = logging.getLogger(__name__)

LOSS_TERMS = ("loss", "policy_loss", "kl_reference")
"""Step metrics that are sums (each already divided by the mini-batch's global counts): they add
up over micro-batches and ranks. The other per-token diagnostics are token-weighted means."""


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


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def score(
    model: torch.nn.Module,
    batch: TrainTensors,
    temperature: float,
    micro_batch_tokens: int,
    reference_model: torch.nn.Module | None = None,
    rows: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """pi_prox (the model as it is now, no gradient) and, with `reference_model`, pi_ref of every
    token of `rows` (default: all); [B, T] on CPU, zero in the other rows."""
    model.eval()
    proximal_bt = torch.zeros_like(batch.behaviour_logprobs_bt)
    reference_bt = torch.zeros_like(proximal_bt) if reference_model is not None else None
    rows = list(range(batch.num_rows)) if rows is None else rows
    for micro_rows in micro_batch_rows(batch, rows, micro_batch_tokens):
        micro = batch.select(micro_rows).to(_device(model))
        width = micro.input_ids_bt.shape[1]
        vision = micro.vision()
        logprobs_bt, _ = sequence_logprobs(
            model, micro.input_ids_bt, micro.attention_mask_bt, temperature, vision=vision
        )
        proximal_bt[micro_rows, :width] = logprobs_bt.float().cpu()
        if reference_bt is not None and reference_model is not None:  # both or neither
            logprobs_bt, _ = sequence_logprobs(
                reference_model, micro.input_ids_bt, micro.attention_mask_bt, temperature, vision=vision
            )
            reference_bt[micro_rows, :width] = logprobs_bt.float().cpu()
    return proximal_bt, reference_bt


def apply_correction(
    batch: TrainTensors, proximal_bt: torch.Tensor, reference_bt: torch.Tensor | None, algorithm: Algorithm
) -> dict[str, float]:
    """Set `batch`'s anchors, correction weights and reference log-probs in place from pi_prox of
    the whole batch; returns the correction's diagnostics."""
    mask = batch.loss_mask_bt
    correction = algorithm.correction(proximal_bt, batch.behaviour_logprobs_bt, mask, batch.advantages_bt)
    batch.anchor_logprobs_bt = correction.anchor_logprobs_bt
    batch.weights_bt = correction.weights_bt
    batch.reference_logprobs_bt = reference_bt
    batch.proximal_logprobs_bt = proximal_bt
    log_rho = token_log_rho(proximal_bt, batch.behaviour_logprobs_bt, mask)
    return {
        **correction.stats,
        **rejection_stats(correction.weights_bt, log_rho, batch.advantages_bt, mask),
        "mismatch_kl": mismatch_kl(proximal_bt, batch.behaviour_logprobs_bt, mask),
    }


def policy_loss(
    model: torch.nn.Module,
    batch: TrainTensors,
    algorithm: Algorithm,
    temperature: float,
    counts: BatchCounts,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The differentiable loss of `batch` (one micro-batch of a mini-batch with `counts`, its
    anchors and weights set by `apply_correction`)."""
    config = algorithm.config
    assert batch.anchor_logprobs_bt is not None and batch.weights_bt is not None, "apply_correction first"
    mask = batch.loss_mask_bt
    logprobs_bt, entropy_bt = sequence_logprobs(
        model,
        batch.input_ids_bt,
        batch.attention_mask_bt,
        temperature,
        with_entropy=True,
        entropy_grad=config.entropy_coef > 0,
        vision=batch.vision(),
    )
    assert entropy_bt is not None  # asked for with_entropy
    scale_bt = token_scale(config.aggregation, mask, counts)
    output = algorithm.loss(
        LossInputs(
            logprobs_bt=logprobs_bt,
            anchor_logprobs_bt=batch.anchor_logprobs_bt,
            weights_bt=batch.weights_bt,
            advantages_bt=batch.advantages_bt,
            loss_mask_bt=mask,
            token_scale_bt=scale_bt,
        )
    )
    loss = output.loss
    stats = {"policy_loss": float(output.loss.detach()), **output.stats}
    if config.kl_coef > 0:
        assert batch.reference_logprobs_bt is not None, "kl_coef > 0 needs reference log-probs"
        # DeepSeek-V3.2's unbiased estimate: weighted by pi_theta / mu like the policy term, so its
        # gradient is the reverse KL's for k1 and k3 (algo/kl.py)
        kl_bt = sampled_kl_per_token(
            logprobs_bt,
            batch.anchor_logprobs_bt,
            batch.weights_bt,
            batch.reference_logprobs_bt,
            config.kl_estimator,
        )
        kl = (kl_bt * scale_bt).sum()
        loss = loss + config.kl_coef * kl
        stats["kl_reference"] = float(kl.detach())
    if config.entropy_coef > 0:
        loss = loss - config.entropy_coef * (entropy_bt * scale_bt).sum()
    stats["entropy"] = float(entropy_bt.detach()[mask].mean()) if bool(mask.any()) else 0.0
    return loss, stats


def minibatch_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    master: MasterWeights,
    minibatch: TrainTensors,
    algorithm: Algorithm,
    config: TrainerConfig,
    temperature: float,
    counts: BatchCounts,
    ranks: Ranks | None = None,
) -> dict[str, float]:
    """One optimizer step on `minibatch` (this rank's share of a mini-batch with `counts`),
    accumulated over its micro-batches. Returns the mini-batch's loss terms (summed), the
    token-weighted means of the per-token diagnostics and the gradient norm, over every rank."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = defaultdict(float)
    device = _device(model)
    for rows in micro_batch_rows(minibatch, list(range(minibatch.num_rows)), config.micro_batch_tokens):
        micro = minibatch.select(rows).to(device)
        loss, stats = policy_loss(model, micro, algorithm, temperature, counts)
        loss.backward()
        master.accumulate_gradients()  # in fp32 at once: a bf16 sum would round every addition
        tokens = micro.num_loss_tokens
        sums["loss"] += float(loss.detach())
        for key, value in stats.items():
            # Loss terms are already globally normalised (they add up); fractions are averaged.
            sums[key] += value if key in LOSS_TERMS else value * tokens
        sums["tokens"] += tokens
    sums = distributed.sum_over_ranks(sums, ranks or Ranks.one(device))
    grad_norm = torch.nn.utils.clip_grad_norm_(master.parameters(), config.max_grad_norm)  # global
    optimizer.step()
    master.master_to_model()
    model.eval()
    tokens = max(1.0, sums.pop("tokens"))
    out = {key: value if key in LOSS_TERMS else value / tokens for key, value in sums.items()}
    out["grad_norm"] = float(grad_norm)
    return out


def num_minibatches(config: TrainerConfig, num_rows: int, ranks: Ranks) -> int:
    """`config.minibatches_per_version`, or fewer when a mini-batch would be left without a row
    on some rank (every rank's forward and backward are collectives). The sizes are checked when
    the trainer starts (`check_ranks`), so only a batch the staleness bound shrank takes fewer."""
    fitting = min(config.minibatches_per_version, num_rows // ranks.data_parallel_size)
    if fitting < config.minibatches_per_version and ranks.is_main:
        log.warning(
            "%d sequences over %d rank(s): %d mini-batches this version instead of %d",
            num_rows,
            ranks.data_parallel_size,
            fitting,
            config.minibatches_per_version,
        )
    return fitting


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
    master: MasterWeights | None = None,
    ranks: Ranks | None = None,
) -> dict[str, float]:
    """Update `model` on `batch` (trainer at `policy_version`): pi_prox once, then one optimizer
    step per mini-batch, for each of `config.epochs` passes. `master` holds what `optimizer` steps
    (default: the trainable fp32 parameters themselves; on several ranks it must have been built
    right after sharding, since FSDP2 leaves the root's parameters unsharded after a forward).
    With `ranks`, a collective: every rank passes the whole batch. Returns the version's
    diagnostics over the whole batch, mini-batch values averaged."""
    ranks = ranks or Ranks.one(_device(model))
    master = master or MasterWeights(model)
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(config, policy_version)
    if ranks.sharded:
        # Every rank must run the same number of forward/backward passes (each is a collective
        # under FSDP2): a rank's share of a pass is one micro-batch, whatever micro_batch_tokens says.
        config = config.model_copy(update={"micro_batch_tokens": 2**62})
    if algorithm.config.kl_coef > 0:
        assert reference_model is not None, "kl_coef > 0 needs the reference model"
    mine = list(range(batch.num_rows))[distributed.row_slice(batch.num_rows, ranks)]
    kl_reference = reference_model if algorithm.config.kl_coef > 0 else None
    proximal_bt, reference_bt = score(
        model, batch, temperature, config.micro_batch_tokens, kl_reference, mine
    )
    proximal_bt = distributed.sum_rows(proximal_bt, ranks)
    reference_bt = None if reference_bt is None else distributed.sum_rows(reference_bt, ranks)
    correction_stats = apply_correction(batch, proximal_bt, reference_bt, algorithm)

    def update(rows: list[int], counts: BatchCounts) -> dict[str, float]:
        share = batch.select(rows[distributed.row_slice(len(rows), ranks)])
        return minibatch_update(
            model, optimizer, master, share, algorithm, config, temperature, counts, ranks
        )

    metrics = optimizer_steps(batch, config, max_new_tokens, ranks, update)
    return version_metrics(metrics, optimizer, batch, ranks, correction_stats, policy_version)


def optimizer_steps(
    batch: TrainTensors,
    config: TrainerConfig,
    max_new_tokens: int,
    ranks: Ranks,
    update: Callable[[list[int], BatchCounts], dict[str, float]],
) -> dict[str, float]:
    """Every optimizer step of the version (`version_schedule`), each taken by `update(rows,
    counts)` on one mini-batch's rows and global counts; the steps' values averaged, the clip
    fraction taken over every loss token of the version."""
    per_minibatch: dict[str, list[float]] = defaultdict(list)
    clipped, tokens = 0.0, 0
    schedule = version_schedule(batch.num_rows, num_minibatches(config, batch.num_rows, ranks), config.epochs)
    for rows in schedule:
        minibatch = batch.select(rows)
        counts = BatchCounts(
            num_loss_tokens=minibatch.num_loss_tokens,
            num_sequences=minibatch.num_rows,
            max_new_tokens=max_new_tokens,
        )
        stats = update(rows, counts)
        for key, value in stats.items():
            per_minibatch[key].append(value)
        clipped += stats.get("clip_fraction", 0.0) * minibatch.num_loss_tokens
        tokens += minibatch.num_loss_tokens
    metrics = {key: sum(values) / len(values) for key, values in per_minibatch.items()}
    if "clip_fraction" in metrics:  # over every loss token of the version, not per mini-batch
        metrics["clip_fraction"] = clipped / max(1, tokens)
    metrics["num_minibatches"] = float(len(per_minibatch["grad_norm"]))
    return metrics


def version_metrics(
    metrics: dict[str, float],
    optimizer: torch.optim.Optimizer,
    batch: TrainTensors,
    ranks: Ranks,
    correction_stats: dict[str, float],
    policy_version: int,
) -> dict[str, float]:
    """The version's diagnostics: its optimizer steps', the batch's, the correction's."""
    return {
        **metrics,
        "lr": optimizer.param_groups[0]["lr"],
        "reward_mean": float(batch.rewards_b.mean()),
        "num_loss_tokens": float(batch.num_loss_tokens),
        "num_rollouts": float(batch.rewards_b.numel()),
        "num_ranks": float(ranks.world_size),
        **({"num_stages": float(ranks.stages)} if ranks.pipelined else {}),
        **correction_stats,
        **staleness_stats(batch, policy_version),
    }
