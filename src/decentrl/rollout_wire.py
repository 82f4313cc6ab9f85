"""Wire types of a worker's work: the sampling it must use, the leases it asks for and the rollouts
it submits (docs/protocol.md, "The rollout").

A lease names the tasks, the slots of their groups and the sampling; in a staged run also the route
of stage holders the driver runs each episode through. A rollout carries its tokens by source, with
the sampling log-probs and versions of the model's, and, staged, each model segment's trace through
the pipeline. Part of the wire types `protocol.py` gathers; imports neither torch nor any role.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from decentrl.envd_wire import ServedEpisode
from decentrl.image_wire import MAX_ROLLOUT_IMAGES, RolloutImage
from decentrl.weights_wire import PEER_ADDRESS
from decentrl.wire import MAX_LIST, MAX_VERSION, Label, Wire


class SamplingParams(Wire):
    """How a worker must sample; leased by the coordinator and echoed back with each rollout."""

    temperature: float = Field(default=1.0, ge=0.0, le=10.0)
    max_new_tokens: int = Field(default=16, ge=1, le=MAX_LIST)
    max_context: int | None = Field(default=None, ge=2, le=1 << 24)
    """The model's context length: the prompt, every model turn and every environment turn of an
    episode fit in it (`envs/episode.py`). None: the model does not say (no bound beyond the budget)."""


# ---------------------------------------------------------------- leasing


class WeightsReceived(Wire):
    """How a worker's last weight update arrived (self-reported: the dashboard's traffic panel)."""

    version: int = Field(..., ge=0)
    coordinator_bytes: int = Field(..., ge=0)
    peer_bytes: int = Field(..., ge=0)


MAX_HOP_TIMINGS = 64
"""Hop timings one lease request may carry: a driver keeps its most recent ones."""
MAX_STEP_MS = 120_000.0
"""The longest step round trip a driver reports (its hop timeout is 30 s per read)."""


class HopTiming(Wire):
    """How long a driver waited for one holder of one of its leases' routes, per decode step.

    The wall time from sending a decode step's request to having its answer: the network both
    ways (through the relay, for a relayed hop), the holder's queue and its compute. Not net of
    the holder's compute: a holder's word on that cannot be checked, and the whole wait is what
    each token costs the driver on that hop. Self-reported, so it only ever steers the reporting
    driver's own routes (`coordinator/route_latency.py`)."""

    lease_id: Label = Field(..., max_length=64)
    stage: int = Field(..., ge=1, le=1024)
    worker_id: Label = Field(..., max_length=64)
    """The holder: the one the coordinator routed that stage of that lease through."""
    steps: int = Field(..., ge=1, le=1 << 20)
    """Decode steps timed (the prefill, whose body is the whole prompt, is not)."""
    step_ms: float = Field(..., ge=0.0, le=MAX_STEP_MS, allow_inf_nan=False)
    """Their median round trip, in milliseconds."""


class LeaseRequest(Wire):
    policy_version: int = Field(..., ge=0, le=MAX_VERSION)
    """The version the worker's engine holds now; it must be within `max_staleness` of the latest."""
    stage: int | None = Field(default=None, ge=0, le=0)
    """A staged run's lease requests say 0: the worker holds stage 0 and drives (docs/pipeline.md)."""
    max_groups: int = Field(default=1, ge=1, le=256)
    weights_received: WeightsReceived | None = None
    """The bytes of the worker's last weight update, by source; sent once, with the next lease."""
    wait_seconds: float = Field(default=0.0, ge=0.0, le=5.0)
    """With no lease to grant now (the untrained groups at `max_pending_groups`), wait up to this
    long for room before answering 204 (a long poll, instead of polling on a timer)."""
    hop_timings: list[HopTiming] = Field(default_factory=list, max_length=MAX_HOP_TIMINGS)
    """A driver's step round trips through the holders of its earlier leases, each hop once, sent
    with the next lease request; the coordinator routes its later leases by them."""


class TaskSpec(Wire):
    task_id: str
    group_id: str
    env: str
    prompt_token_ids: list[int]
    slots: list[int]
    """Sample indices of the group this lease asks for (one rollout per slot)."""
    seed: int | None = None
    """The problem's seed: a worker rebuilds the problem to play environment turns."""


class RouteHop(Wire):
    """One stage holder of a leased route: where the driver sends that stage's steps."""

    stage: int = Field(..., ge=1)
    worker_id: str
    url: str | None = Field(default=None, max_length=64, pattern=PEER_ADDRESS)
    """Where the holder accepts the driver's connections; None when it cannot (behind NAT)."""
    public_key: str = Field(..., pattern=r"^[0-9a-f]{64}$")
    """The holder's registered key: the commitments it signs verify under it."""
    relayed: bool = False
    """Send this hop's steps through the coordinator's relay (`coordinator/stage_relay.py`): the
    holder accepts no connections, or the coordinator could not reach the address it announced."""


class Lease(Wire):
    lease_id: str
    deadline_unix: float
    sampling: SamplingParams
    tasks: list[TaskSpec]
    route: list[RouteHop] | None = None
    """A staged run: one holder for each stage after the first, in stage order, all holding
    `policy_version`; the driver (the first stage's holder) runs every episode through them."""
    policy_version: int | None = None
    """A routed lease: the version every stage of the route computes at (the driver's, when it asked)."""


# ---------------------------------------------------------------- rollouts


class Segment(Wire):
    """A run of tokens from one source. Model tokens carry sampling log-probs and versions."""

    source: Literal["model", "env"]
    token_ids: list[int] = Field(..., min_length=1, max_length=MAX_LIST)
    logprobs: list[float] | None = Field(default=None, max_length=MAX_LIST)
    policy_versions: list[int] | None = Field(default=None, max_length=MAX_LIST)


class HopRecord(Wire):
    """One stage holder's part in one model segment of a staged rollout: its signed commitment to
    what it received and answered for this sequence, and those bytes (worker/stage_wire.py)."""

    stage: int = Field(..., ge=1, le=1024)
    holder_id: Label = Field(..., max_length=64)
    session: Label = Field(..., max_length=64)
    row: int = Field(..., ge=0, le=MAX_LIST)
    version: int = Field(..., ge=0, le=MAX_VERSION)
    steps: int = Field(..., ge=1, le=MAX_LIST)
    input_chain: str = Field(..., pattern=r"^[0-9a-f]{64}$")
    output_chain: str = Field(..., pattern=r"^[0-9a-f]{64}$")
    signature: str = Field(..., pattern=r"^[0-9a-f]{128}$")
    inputs: str = Field(..., max_length=1 << 26)
    """Base64 of the row's input payloads, step after step (hidden states in the trace's codec)."""
    outputs: str = Field(..., max_length=1 << 26)
    """Base64 of the row's answers: hidden states, or the last stage's sampled (token, log-prob) per
    step (`stage_wire.sampled_bytes`)."""


class StageTrace(Wire):
    """How one model segment of a rollout went through the pipeline (docs/pipeline.md)."""

    codec: Label = Field(..., max_length=16)
    width: int = Field(..., ge=1, le=MAX_LIST)
    """Columns of the session's prefill (the batch's longest prompt; this row is left-padded to it)."""
    prompt_length: int = Field(..., ge=1, le=MAX_LIST)
    """Real tokens of this row's prompt (the rest of `width` is padding)."""
    hops: list[HopRecord] = Field(..., min_length=1, max_length=1024)


class Rollout(Wire):
    lease_id: Label = Field(..., max_length=64)
    task_id: Label = Field(..., max_length=64)
    slot: int = Field(..., ge=0, le=MAX_LIST)
    prompt_token_ids: list[int] = Field(..., min_length=1, max_length=MAX_LIST)
    segments: list[Segment] = Field(..., min_length=1, max_length=1024)
    sampling: SamplingParams
    finish_reason: Literal["stop", "length"]
    transcript: list[dict] = Field(default_factory=list, max_length=1024)
    timings: dict[Label, float] = Field(default_factory=dict, max_length=32)
    claimed_reward: float | None = None
    """Ignored by the coordinator (rewards are recomputed); kept so it can be logged."""
    stage_traces: list[StageTrace] | None = Field(default=None, max_length=1024)
    """A staged run: one trace per model segment, in order (docs/pipeline.md)."""
    served: ServedEpisode | None = None
    """A served environment's episode (`task.served`): the env server's signed turns and end,
    checked by the coordinator in place of a replay (`envd_wire.py`)."""
    images: list[RolloutImage] | None = Field(default=None, max_length=MAX_ROLLOUT_IMAGES)
    """A vision-language policy: the images of the rollout's image tokens, in order; None: none."""


class RolloutSubmission(Wire):
    rollouts: list[Rollout] = Field(..., min_length=1, max_length=4096)


class SubmissionResult(Wire):
    accepted: list[str]
    """Rollout ids, committed to the store before this answer was sent."""
    groups_completed: int
    """Groups whose every slot this submission filled; each is trained once its rewards are scored
    (after this answer, in the coordinator's scoring pool) and its sampled verifications are in."""
