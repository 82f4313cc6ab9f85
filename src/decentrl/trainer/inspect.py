"""The trainer's log-probs of a few trained rollouts, for the dashboard's rollout inspector.

Computed with `sequence_logprobs`, the function the loss uses for the proximal policy, on the
model before its update: beside a worker's sampling log-probs they show per token how far the
worker's engine (and its version, when the rollout is stale) is from the trainer.
"""

from __future__ import annotations

import torch

from decentrl.algo.logprobs import sequence_logprobs
from decentrl.protocol import RolloutLogprobs, TrainGroup
from decentrl.trainer.batch import TrainTensors


def rollout_logprobs(
    model: torch.nn.Module, groups: list[TrainGroup], tensors: TrainTensors, temperature: float, limit: int
) -> list[RolloutLogprobs]:
    """The first `limit` rollouts of the batch (rows of `tensors`, collated in group order)."""
    rollouts = [rollout for group in groups for rollout in group.rollouts][:limit]
    if not rollouts:
        return []
    rows = len(rollouts)
    device = next(model.parameters()).device
    with torch.no_grad():
        logprobs_bt, _ = sequence_logprobs(
            model,
            tensors.input_ids_bt[:rows].to(device),
            tensors.attention_mask_bt[:rows].to(device),
            temperature,
        )
    logprobs_bt = logprobs_bt.float().cpu()
    return [
        RolloutLogprobs(
            rollout_id=rollout.rollout_id, logprobs=logprobs_bt[row][tensors.loss_mask_bt[row]].tolist()
        )
        for row, rollout in enumerate(rollouts)
    ]
