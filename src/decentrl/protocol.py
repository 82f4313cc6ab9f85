"""Wire types shared by every role (see docs/protocol.md).

Everything that crosses the network is one of these pydantic models. They are strict
(`extra="forbid"`) so a malformed or padded body is a 422 with a message, never a silent
partial parse. This module imports neither torch nor any role.

Every role imports them from here. They are defined beside the others of their family of routes:
`registration_wire.py` (joining a run: registration and `ServerInfo`), `rollout_wire.py` (sampling,
leases and rollouts), `training_wire.py` (the trainer's batches, acks, metrics and run record),
`weights_wire.py` (published versions, the keys that sign them, peers) and `job_wire.py` (the jobs
of the trusted verifier and scorer), all built on `wire.py`'s base types.
"""

from __future__ import annotations

from decentrl.envd_wire import ServedEpisode
from decentrl.image_wire import MAX_ROLLOUT_IMAGES, RolloutImage
from decentrl.job_wire import (
    ScoreJob,
    ScoreJobs,
    ScoreJobsRequest,
    TermScore,
    TermScoreBatch,
    Verdict,
    VerdictBatch,
    VerifyJob,
    VerifyJobs,
    VerifyJobsRequest,
)
from decentrl.registration_wire import (
    Challenge,
    DeclaredDevice,
    DeclaredDtype,
    RegisterRequest,
    RegisterResponse,
    ServerInfo,
)
from decentrl.rollout_wire import (
    MAX_HOP_TIMINGS,
    MAX_STEP_MS,
    HopRecord,
    HopTiming,
    Lease,
    LeaseRequest,
    Rollout,
    RolloutSubmission,
    RouteHop,
    SamplingParams,
    Segment,
    StageTrace,
    SubmissionResult,
    TaskSpec,
    WeightsReceived,
)
from decentrl.stage_map import StageMap
from decentrl.training_wire import (
    TRAINER_SECTIONS,
    BatchAck,
    BatchRequest,
    RolloutLogprobs,
    StepMetrics,
    TrainBatch,
    TrainerRun,
    TrainGroup,
    TrainRollout,
)
from decentrl.weights_wire import (
    PEER_ADDRESS,
    PeerAnnounce,
    PeerInfo,
    PeerReport,
    TrainerKey,
    TrainerPeerAnnounce,
    WeightsEntry,
    WeightsInfo,
)
from decentrl.wire import MAX_LIST, MAX_VERSION, Label, Wire

API_PREFIX = "/v1"
SERVER_TIME_HEADER = "X-Decentrl-Server-Time"
"""Sent with a 401 for a signature timestamp outside the coordinator's window: its clock, so that the
client can correct its own and sign again."""


class ErrorBody(Wire):
    detail: str


__all__ = [
    "API_PREFIX",
    "SERVER_TIME_HEADER",
    "ErrorBody",
    # registration_wire.py: joining a run
    "DeclaredDtype",
    "DeclaredDevice",
    "RegisterRequest",
    "Challenge",
    "RegisterResponse",
    "ServerInfo",
    # rollout_wire.py: sampling, leases and rollouts
    "SamplingParams",
    "WeightsReceived",
    "MAX_HOP_TIMINGS",
    "MAX_STEP_MS",
    "HopTiming",
    "LeaseRequest",
    "TaskSpec",
    "RouteHop",
    "Lease",
    "Segment",
    "HopRecord",
    "StageTrace",
    "Rollout",
    "RolloutSubmission",
    "SubmissionResult",
    # training_wire.py: the trainer's batches and reports
    "BatchRequest",
    "TrainRollout",
    "TrainGroup",
    "TrainBatch",
    "BatchAck",
    "RolloutLogprobs",
    "StepMetrics",
    "TRAINER_SECTIONS",
    "TrainerRun",
    # weights_wire.py: versions, keys and peers
    "PEER_ADDRESS",
    "WeightsInfo",
    "WeightsEntry",
    "TrainerKey",
    "PeerAnnounce",
    "TrainerPeerAnnounce",
    "PeerInfo",
    "PeerReport",
    # job_wire.py: the verifier's and the scorer's jobs
    "VerifyJobsRequest",
    "VerifyJob",
    "VerifyJobs",
    "Verdict",
    "VerdictBatch",
    "ScoreJobsRequest",
    "ScoreJob",
    "ScoreJobs",
    "TermScore",
    "TermScoreBatch",
    # wire.py: the base types
    "MAX_LIST",
    "MAX_VERSION",
    "Label",
    "Wire",
    # image_wire.py: a rollout's images
    "MAX_ROLLOUT_IMAGES",
    "RolloutImage",
    # envd_wire.py: a served episode
    "ServedEpisode",
    # stage_map.py: the pipeline's stages
    "StageMap",
]
