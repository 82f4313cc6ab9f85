"""The trainer's log-probs of a few trained rollouts, for the dashboard's rollout inspector.

They are pi_prox of those rollouts (`sequence_logprobs` on the model before its update, computed
once per version for the loss; no pass of their own): beside a worker's sampling log-probs they
show per token how far the worker's engine (and its version, when the rollout is stale) is from
the trainer.
"""

from __future__ import annotations

from decentrl.protocol import RolloutLogprobs, TrainGroup
from decentrl.trainer.batch import TrainTensors


def rollout_logprobs(groups: list[TrainGroup], tensors: TrainTensors, limit: int) -> list[RolloutLogprobs]:
    """The first `limit` rollouts of the batch (rows of `tensors`, collated in group order), from
    the pi_prox log-probs its version step set."""
    rollouts = [rollout for group in groups for rollout in group.rollouts][:limit]
    if not rollouts:
        return []
    assert tensors.proximal_logprobs_bt is not None, "train_step sets pi_prox"
    return [
        RolloutLogprobs(
            rollout_id=rollout.rollout_id,
            logprobs=tensors.proximal_logprobs_bt[row][tensors.loss_mask_bt[row]].tolist(),
        )
        for row, rollout in enumerate(rollouts)
    ]
