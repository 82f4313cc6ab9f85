"""Turn groups of rollouts (wire format) into right-padded training tensors.

Token ids travel end to end: the prompt ids and each segment's ids are concatenated as the
worker produced them, never re-tokenised. Only model-sampled tokens enter the loss; env tokens
(and padding) are masked out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from decentrl.algo.advantages import AdvantageEstimator
from decentrl.protocol import TrainGroup, TrainRollout

RewardShaping = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(rewards_b, num_model_tokens_b) -> shaped rewards_b, e.g. DAPO's overlong penalty."""


@dataclass
class TrainTensors:
    input_ids_bt: torch.Tensor
    attention_mask_bt: torch.Tensor
    loss_mask_bt: torch.Tensor
    behaviour_logprobs_bt: torch.Tensor
    policy_versions_bt: torch.Tensor
    """Version that sampled each loss token (-1 elsewhere)."""
    advantages_bt: torch.Tensor
    rewards_b: torch.Tensor
    """Trusted rewards as the coordinator computed them (before any shaping)."""

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask_bt.sum())


def num_model_tokens(rollout: TrainRollout) -> int:
    return sum(len(s.token_ids) for s in rollout.segments if s.source == "model")


def group_advantages(
    groups: list[TrainGroup], estimator: AdvantageEstimator, shaping: RewardShaping | None = None
) -> list[float]:
    """One advantage per rollout, in batch order, from the (optionally shaped) trusted rewards."""
    rewards = []
    for group in groups:
        rewards_g = torch.tensor([r.reward for r in group.rollouts], dtype=torch.float32)
        if shaping is not None:
            lengths_g = torch.tensor([num_model_tokens(r) for r in group.rollouts])
            rewards_g = shaping(rewards_g, lengths_g)
        rewards.append(rewards_g)
    return torch.cat(estimator(rewards)).tolist()


def collate(
    groups: list[TrainGroup],
    pad_token_id: int,
    estimator: AdvantageEstimator,
    shaping: RewardShaping | None = None,
) -> TrainTensors:
    rows: list[tuple[list[int], list[int], list[float], list[int]]] = []
    advantages = group_advantages(groups, estimator, shaping)
    rewards = [r.reward for group in groups for r in group.rollouts]
    for group in groups:
        for rollout in group.rollouts:
            ids, mask, behaviour, versions = list(rollout.prompt_token_ids), [], [], []
            mask += [0] * len(ids)
            behaviour += [0.0] * len(ids)
            versions += [-1] * len(ids)
            for segment in rollout.segments:
                ids += segment.token_ids
                is_model = segment.source == "model"
                mask += [int(is_model)] * len(segment.token_ids)
                behaviour += segment.logprobs if is_model else [0.0] * len(segment.token_ids)
                versions += segment.policy_versions if is_model else [-1] * len(segment.token_ids)
            rows.append((ids, mask, behaviour, versions))
    width = max(len(ids) for ids, *_ in rows)
    batch = len(rows)
    tensors = TrainTensors(
        input_ids_bt=torch.full((batch, width), pad_token_id, dtype=torch.long),
        attention_mask_bt=torch.zeros((batch, width), dtype=torch.long),
        loss_mask_bt=torch.zeros((batch, width), dtype=torch.bool),
        behaviour_logprobs_bt=torch.zeros((batch, width)),
        policy_versions_bt=torch.full((batch, width), -1, dtype=torch.long),
        advantages_bt=torch.zeros((batch, width)),
        rewards_b=torch.tensor(rewards),
    )
    for row, (ids, mask, behaviour, versions) in enumerate(rows):
        n = len(ids)
        tensors.input_ids_bt[row, :n] = torch.tensor(ids)
        tensors.attention_mask_bt[row, :n] = 1
        tensors.loss_mask_bt[row, :n] = torch.tensor(mask, dtype=torch.bool)
        tensors.behaviour_logprobs_bt[row, :n] = torch.tensor(behaviour)
        tensors.policy_versions_bt[row, :n] = torch.tensor(versions)
        tensors.advantages_bt[row, :n] = advantages[row]
    return tensors
