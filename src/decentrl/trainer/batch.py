"""Turn groups of rollouts (wire format) into right-padded training tensors.

Token ids travel end to end: the prompt ids and each segment's ids are concatenated as the
worker produced them, never re-tokenised. Only model-sampled tokens enter the loss; env tokens,
image tokens (part of the prompt) and padding are masked out. A vision-language policy's rows
carry their images' pixel values beside the ids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from decentrl.algo.advantages import AdvantageEstimator
from decentrl.protocol import RolloutLogprobs, TrainGroup, TrainRollout

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
    anchor_logprobs_bt: torch.Tensor | None = None
    """The trust region's anchor per token, set once per version by the off-policy correction."""
    weights_bt: torch.Tensor | None = None
    """The correction's per-token weight (0 = rejected), set with the anchor."""
    reference_logprobs_bt: torch.Tensor | None = None
    """log pi_ref of each token when a KL penalty needs it, set with the anchor."""
    proximal_logprobs_bt: torch.Tensor | None = None
    """log pi_prox of each token (the model at the version's start), set with the anchor."""
    pixel_values_bichw: torch.Tensor | None = None
    """A vision-language policy: each row's images' pixel values, [B, most images of a row, C, H, W]
    (rows with fewer images padded with zeros); None for a text policy."""
    num_images_b: torch.Tensor | None = None
    """Images of each row (the first ones of `pixel_values_bichw`)."""

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask_bt.sum())

    @property
    def num_rows(self) -> int:
        return self.input_ids_bt.shape[0]

    def select(self, rows: list[int]) -> TrainTensors:
        """The given rows, cut to their longest sequence (right padding beyond it is dropped)."""
        index = torch.tensor(rows, dtype=torch.long)
        width = max(1, int(self.attention_mask_bt[index].sum(-1).max()))
        picked = {}
        for field in fields(self):
            tensor = getattr(self, field.name)
            if tensor is not None:
                tensor = tensor[index]
                picked[field.name] = tensor[:, :width] if tensor.dim() == 2 else tensor
        return TrainTensors(**picked)

    def vision(self) -> dict[str, torch.Tensor] | None:
        """The pixel inputs of the rows' images, row after row (as `sequence_logprobs` takes them),
        or None when no row has one."""
        if self.pixel_values_bichw is None or self.num_images_b is None or int(self.num_images_b.sum()) == 0:
            return None
        slots = torch.arange(self.pixel_values_bichw.shape[1], device=self.num_images_b.device)
        present_bi = slots[None, :] < self.num_images_b[:, None]
        return {"pixel_values": self.pixel_values_bichw[present_bi]}

    def to(self, device: torch.device) -> TrainTensors:
        moved: dict[str, Any] = {
            f.name: None if (t := getattr(self, f.name)) is None else t.to(device) for f in fields(self)
        }
        return TrainTensors(**moved)


def minibatch_rows(num_rows: int, num_minibatches: int) -> list[list[int]]:
    """Rows of each mini-batch: consecutive, as equal as possible (whole groups stay together
    when the number of groups divides evenly), never an empty one."""
    count = min(num_minibatches, num_rows)
    bounds = [round(i * num_rows / count) for i in range(count + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(count)]


def version_schedule(num_rows: int, num_minibatches: int, epochs: int) -> list[list[int]]:
    """Rows of each optimizer step of one version: `epochs` passes over the batch, each cut into
    the same mini-batches in the same order (every step is against the one pi_prox of the version)."""
    return [rows for _ in range(epochs) for rows in minibatch_rows(num_rows, num_minibatches)]


def micro_batch_rows(batch: TrainTensors, rows: list[int], max_tokens: int) -> list[list[int]]:
    """`rows` packed into micro-batches of at most `max_tokens` padded tokens (rows x longest),
    longest first so rows of similar length share one; a row longer than the budget goes alone."""
    lengths = batch.attention_mask_bt.sum(-1).tolist()
    ordered = sorted(rows, key=lambda row: -lengths[row])
    micro: list[list[int]] = []
    for row in ordered:
        # The first row of a micro-batch is its longest, so rows x that length is its padded size.
        if micro and (len(micro[-1]) + 1) * lengths[micro[-1][0]] <= max_tokens:
            micro[-1].append(row)
        else:
            micro.append([row])
    return micro


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
    pixel_rows: list[torch.Tensor] | None = None,
) -> TrainTensors:
    """The batch as tensors; `pixel_rows` (a vision-language policy): each rollout's images'
    pixel values [N, C, H, W], in batch order."""
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
                if is_model:  # the coordinator accepts no model segment without both lists
                    assert segment.logprobs is not None and segment.policy_versions is not None
                    behaviour += segment.logprobs
                    versions += segment.policy_versions
                else:
                    behaviour += [0.0] * len(segment.token_ids)
                    versions += [-1] * len(segment.token_ids)
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
    if pixel_rows is not None:
        tensors.pixel_values_bichw, tensors.num_images_b = stack_images(pixel_rows)
    return tensors


def stack_images(pixel_rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's [N_i, C, H, W] pixel values as one zero-padded [B, max N_i, C, H, W] and the N_i."""
    counts_b = torch.tensor([len(pixels) for pixels in pixel_rows], dtype=torch.long)
    shape = next((pixels.shape[1:] for pixels in pixel_rows if len(pixels)), (3, 1, 1))
    stacked = torch.zeros((len(pixel_rows), max(1, int(counts_b.max())), *shape))
    for row, pixels in enumerate(pixel_rows):
        stacked[row, : len(pixels)] = pixels
    return stacked, counts_b


def rollout_logprobs(groups: list[TrainGroup], tensors: TrainTensors, limit: int) -> list[RolloutLogprobs]:
    """For the dashboard's rollout inspector: pi_prox of the batch's first `limit` rollouts (rows
    of `tensors`, collated in group order), as the version's step computed it for the loss (no
    pass of its own). Beside a worker's sampling log-probs they show per token how far the
    worker's engine (and its version, when the rollout is stale) is from the trainer."""
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


def within_staleness(groups: list[TrainGroup], version: int, max_staleness: int) -> list[TrainGroup]:
    """The trainer's own enforcement of the bound (the coordinator already applied it)."""

    def oldest(group: TrainGroup) -> int:
        return min(
            v for r in group.rollouts for s in r.segments if s.policy_versions for v in s.policy_versions
        )

    return [group for group in groups if version - oldest(group) <= max_staleness]
