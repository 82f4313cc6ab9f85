"""Wire types shared by every role (see docs/protocol.md).

Everything that crosses the network is one of these pydantic models. They are strict
(`extra="forbid"`) so a malformed or padded body is a 422 with a message, never a silent
partial parse. This module imports neither torch nor any role.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

API_PREFIX = "/v1"
# Hard ceilings on list sizes, checked by the schema before any semantic check. The coordinator
# applies tighter, configured limits (max_new_tokens, group size) on top of these.
MAX_LIST = 65_536


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class SamplingParams(Wire):
    """How a worker must sample; leased by the coordinator and echoed back with each rollout."""

    temperature: float = Field(1.0, ge=0.0, le=10.0)
    max_new_tokens: int = Field(16, ge=1, le=MAX_LIST)


# ---------------------------------------------------------------- registration


class RegisterRequest(Wire):
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    engine: str = Field("hf", max_length=32)


class RegisterResponse(Wire):
    worker_id: str
    token: str
    """Bearer token for every later request of this worker."""


class ServerInfo(Wire):
    """What any client needs to know about the run (`GET /v1/info`)."""

    run_id: str
    vocab_size: int
    eos_token_id: int
    pad_token_id: int
    group_size: int
    max_staleness: int
    sampling: SamplingParams
    latest_version: int | None
    model_files: list[str]
    """Non-weight files (config, tokenizer) a worker downloads from `/v1/model/files/{name}`."""
    env_args: dict = Field(default_factory=dict)
    """Keyword arguments of the run's environment (`task.args`); a worker loads the environment
    named by each `TaskSpec.env` with them to play multi-turn episodes."""


# ---------------------------------------------------------------- leasing


class LeaseRequest(Wire):
    policy_version: int = Field(..., ge=0)
    """The version the worker's engine holds now; it must be within `max_staleness` of the latest."""
    max_groups: int = Field(1, ge=1, le=256)


class TaskSpec(Wire):
    task_id: str
    group_id: str
    env: str
    prompt_token_ids: list[int]
    slots: list[int]
    """Sample indices of the group this lease asks for (one rollout per slot)."""
    seed: int | None = None
    """The problem's seed: a worker rebuilds the problem to play environment turns."""


class Lease(Wire):
    lease_id: str
    deadline_unix: float
    sampling: SamplingParams
    tasks: list[TaskSpec]


# ---------------------------------------------------------------- rollouts


class Segment(Wire):
    """A run of tokens from one source. Model tokens carry sampling log-probs and versions."""

    source: Literal["model", "env"]
    token_ids: list[int] = Field(..., min_length=1, max_length=MAX_LIST)
    logprobs: list[float] | None = Field(None, max_length=MAX_LIST)
    policy_versions: list[int] | None = Field(None, max_length=MAX_LIST)


class Rollout(Wire):
    lease_id: str = Field(..., max_length=64)
    task_id: str = Field(..., max_length=64)
    slot: int = Field(..., ge=0)
    prompt_token_ids: list[int] = Field(..., min_length=1, max_length=MAX_LIST)
    segments: list[Segment] = Field(..., min_length=1, max_length=1024)
    sampling: SamplingParams
    finish_reason: Literal["stop", "length"]
    transcript: list[dict] = Field(default_factory=list, max_length=1024)
    timings: dict[str, float] = Field(default_factory=dict, max_length=32)
    claimed_reward: float | None = None
    """Ignored by the coordinator (rewards are recomputed); kept so it can be logged."""


class RolloutSubmission(Wire):
    rollouts: list[Rollout] = Field(..., min_length=1, max_length=4096)


class SubmissionResult(Wire):
    accepted: list[str]
    """Rollout ids, committed to the store before this answer was sent."""
    groups_completed: int


# ---------------------------------------------------------------- training


class BatchRequest(Wire):
    policy_version: int = Field(..., ge=0)
    max_groups: int = Field(..., ge=1, le=4096)
    drop_zero_variance: bool = False
    """Dynamic sampling (DAPO): skip ready groups whose rewards are all equal (they carry no
    advantage signal) and wait until `max_groups` others are ready. Skipped groups are counted."""


class TrainRollout(Wire):
    rollout_id: str
    worker_id: str
    prompt_token_ids: list[int]
    segments: list[Segment]
    finish_reason: Literal["stop", "length"]
    reward: float
    """Trusted reward, computed by the coordinator from the token ids."""


class TrainGroup(Wire):
    group_id: str
    task_id: str
    rollouts: list[TrainRollout]


class TrainBatch(Wire):
    batch_id: str
    groups: list[TrainGroup]
    num_groups_expired: int = 0
    """Groups dropped while assembling this batch because they exceeded `max_staleness`."""


class BatchAck(Wire):
    policy_version: int = Field(..., ge=0)
    """The version the trainer published after training on the batch."""


class StepMetrics(Wire):
    policy_version: int
    metrics: dict[str, float]


class WeightsInfo(Wire):
    version: int
    sha256: str
    num_bytes: int
    created_unix: float


class ErrorBody(Wire):
    detail: str
