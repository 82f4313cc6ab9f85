"""Wire types of the trainer's dealings with the coordinator: the batches of scored groups it asks
for and acks, the metrics of each step, and the settings the run directory keeps (docs/protocol.md,
"Routes"; docs/trainer.md).

Part of the wire types `protocol.py` gathers; imports neither torch nor any role.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from decentrl.image_wire import RolloutImage
from decentrl.rollout_wire import Segment
from decentrl.wire import MAX_LIST, MAX_VERSION, Label, Wire


class BatchRequest(Wire):
    policy_version: int = Field(..., ge=0, le=MAX_VERSION)
    max_groups: int = Field(..., ge=1, le=4096)
    drop_zero_variance: bool = False
    """Dynamic sampling (DAPO): skip ready groups whose rewards are all equal (they carry no
    advantage signal) and wait until `max_groups` others are ready. Skipped groups are counted."""
    held: list[Label] = Field(default=[], max_length=8)
    """Issued batches the trainer holds and will ack (trained, their version being published):
    they are not re-delivered to this request, so the next batch is fetched while they finish.
    Unacked batches outside this list are re-delivered first, oldest first (a restarted trainer
    sends none and gets back every batch it had not acked, in order)."""
    wait_seconds: float = Field(default=0.0, ge=0.0, le=5.0)
    """With fewer than `max_groups` groups ready, wait up to this long for more before answering
    204 (a long poll, instead of polling on a timer)."""


class TrainRollout(Wire):
    rollout_id: str
    worker_id: str
    prompt_token_ids: list[int]
    segments: list[Segment]
    finish_reason: Literal["stop", "length"]
    reward: float
    """Trusted reward, computed by the coordinator from the token ids."""
    images: list[RolloutImage] | None = None
    """As accepted: the images of the rollout's image tokens (the trainer draws them from `seed`)."""


class TrainGroup(Wire):
    group_id: str
    task_id: str
    rollouts: list[TrainRollout]
    seed: int | None = None
    """The task's seed, sent when its rollouts have images: the trainer draws them from it."""


class TrainBatch(Wire):
    batch_id: str
    groups: list[TrainGroup]
    num_groups_expired: int = 0
    """Groups dropped while assembling this batch because they exceeded `max_staleness`."""
    snapshot_requested: bool = False
    """A worker or operator asked for a full snapshot (`POST /v1/weights/snapshot-request`) and
    none newer than the request exists: publish the next version with one."""


class BatchAck(Wire):
    policy_version: int = Field(..., ge=0, le=MAX_VERSION)
    """The version the trainer published after training on the batch."""


class RolloutLogprobs(Wire):
    """The trainer's log-probs of one trained rollout's model tokens, for the dashboard's inspector."""

    rollout_id: Label = Field(..., max_length=64)
    logprobs: list[float] = Field(..., max_length=MAX_LIST)
    """Log-prob of each model token (in order) under the trainer's policy before the update."""


class StepMetrics(Wire):
    policy_version: int = Field(..., ge=0, le=MAX_VERSION)
    metrics: dict[str, float]
    rollout_logprobs: list[RolloutLogprobs] = Field(default_factory=list, max_length=256)
    """A few trained rollouts with the trainer's own log-probs (`monitor.inspect_rollouts`): set
    beside the workers' sampling log-probs, they show the worker-vs-trainer mismatch per token."""


TRAINER_SECTIONS = ("trainer", "lora", "algorithm")
"""The config sections the trainer resolves on its own, which the run directory keeps."""


class TrainerRun(Wire):
    """What the trainer resolves that the run directory must keep (`PUT /v1/trainer/run`): its
    sections of the config (`TRAINER_SECTIONS`), its number of steps, and
    once it has published the last one, that the run is complete."""

    policy_version: int = Field(..., ge=0, le=MAX_VERSION)
    num_steps: int = Field(..., ge=0, le=MAX_VERSION)
    sections: dict[str, dict]
    complete: bool = False
