"""Wire types of served environments: what workers and env servers say to each other and to the
coordinator, and the records an env server signs (docs/protocol.md, "Served environments").

An env server (`decentrl envd`, trusted) runs each episode of a served task in a live instance. It
answers every model turn a worker sends with an `EnvStep` and closes the episode with an `EnvEnd`,
both signed with its Ed25519 key. The worker puts them in its rollout (`ServedEpisode`); the
coordinator checks the signatures and binds them to the rollout (the episode it granted for this
lease and slot, the turn's index, the hash of the text the worker's tokens decode to) in place of
replaying the environment, and trains on the signed reward. `signed_bytes` is the one definition
of what a signature covers, for the server that signs and the coordinator that checks.
"""

from __future__ import annotations

import hashlib
import json
from enum import StrEnum

from pydantic import Field

from decentrl.wire import MAX_LIST, MAX_VERSION, Label, Wire

MAX_OBSERVATION_CHARS = 16_384
MAX_ACTION_CHARS = 65_536
HEX64 = r"^[0-9a-f]{64}$"
EPISODE_ID = r"^e-[0-9a-f]{16}$"


class EnvFailure(StrEnum):
    """Why an episode ended without a reward: never trained, retried up to `task.max_env_retries`."""

    CRASH = "crash"
    """The instance died (its process or its browser)."""
    TIMEOUT = "timeout"
    """A reset or step ran past `envd.step_seconds`."""
    MEMORY = "memory"
    """The instance went over `envd.memory_mb`."""
    ERROR = "error"
    """The environment raised on the episode (its bug, not the model's)."""
    LOST = "lost"
    """The env server stopped announcing itself while the episode was open (declared by the coordinator)."""


SIGNED_REWARD = "signed_reward"
"""Key of the reward an env server signed, on the last message of a served episode as the
coordinator checked it: the rubric's `env` term takes it instead of re-running the environment."""


def action_digest(text: str) -> str:
    """sha256 of a model turn's text, as the worker's tokens decode to it (`ChatFormat.turn_text`)."""
    return hashlib.sha256(text.encode()).hexdigest()


class EnvMessage(Wire):
    role: Label = Field(..., max_length=16)
    content: str = Field(..., max_length=MAX_OBSERVATION_CHARS)


class EnvStep(Wire):
    """The env server's answer to model turn `turn` (1, 2, ...) of an episode, signed."""

    episode_id: str = Field(..., pattern=EPISODE_ID)
    turn: int = Field(..., ge=1, le=1024)
    action_sha256: str = Field(..., pattern=HEX64)
    observation: list[EnvMessage] | None = Field(default=None, max_length=16)
    """The environment's turn; None when this action ended the episode."""
    signature: str = Field(default="", pattern=r"^([0-9a-f]{128})?$")


class EnvEnd(Wire):
    """How an episode ended, signed: its reward, or the failure that ended it without one."""

    episode_id: str = Field(..., pattern=EPISODE_ID)
    server_id: Label = Field(..., max_length=64)
    lease_id: Label = Field(..., max_length=64)
    task_id: Label = Field(..., max_length=64)
    slot: int = Field(..., ge=0, le=MAX_LIST)
    env: Label = Field(..., max_length=64)
    env_version: Label = Field(..., max_length=128)
    seed: int = Field(..., ge=0, le=2**62)
    attempt: int = Field(..., ge=0, le=MAX_VERSION)
    steps: int = Field(..., ge=0, le=1024)
    """Model turns the environment performed."""
    final_action_sha256: str | None = Field(default=None, pattern=HEX64)
    """The episode's last model turn when the environment did not perform it (the episode ran out
    of turns, tokens or context first): part of what the reward may read (a final answer)."""
    reward: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    failure: EnvFailure | None = None
    signature: str = Field(default="", pattern=r"^([0-9a-f]{128})?$")


class ServedEpisode(Wire):
    """A served episode's signed record, in the rollout (`Rollout.served`)."""

    steps: list[EnvStep] = Field(default_factory=list, max_length=1024)
    end: EnvEnd


def signed_bytes(record: EnvStep | EnvEnd) -> bytes:
    """What the env server's signature covers: the record's kind and every field but the signature,
    as canonical JSON."""
    body = record.model_dump(mode="json", exclude={"signature"})
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return f"decentrl-envd-v1\n{type(record).__name__}\n{canonical}".encode()


# ---------------------------------------------------------------- worker -> env server


class ResetRequest(Wire):
    lease_id: Label = Field(..., max_length=64)
    task_id: Label = Field(..., max_length=64)
    slot: int = Field(..., ge=0, le=MAX_LIST)
    screenshot: bool = False
    """Also answer a PNG of the page (environments that have one; multimodal policies)."""


class ResetAnswer(Wire):
    episode_id: str
    attempt: int
    env_version: str
    failed: EnvEnd | None = None
    """Set when the instance failed while opening the episode (signed, with its failure)."""
    screenshot: str | None = None
    """Base64 PNG (with `ResetRequest.screenshot`)."""


class StepRequest(Wire):
    episode_id: str = Field(..., pattern=EPISODE_ID)
    turn: int = Field(..., ge=1, le=1024)
    action: str = Field(..., max_length=MAX_ACTION_CHARS)
    """The model turn's text, as its tokens decode (the hash the coordinator checks)."""
    screenshot: bool = False


class StepAnswer(Wire):
    step: EnvStep
    end: EnvEnd | None = None
    """Set when this step ended the episode (the action finished it, or the instance failed)."""
    screenshot: str | None = None


class EndRequest(Wire):
    episode_id: str = Field(..., pattern=EPISODE_ID)
    final_action: str | None = Field(default=None, max_length=MAX_ACTION_CHARS)
    """The last model turn when the worker's episode ended without sending it (turns, tokens or
    context ran out): it is not performed, but a reward may read it."""


# ---------------------------------------------------------------- env server -> coordinator


class EnvServerAnnounce(Wire):
    """An env server's heartbeat (`PUT /v1/envd/servers`): where workers reach it, its key."""

    server_id: Label = Field(..., max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    url: str = Field(..., max_length=128, pattern=r"^https?://[^\s/]+(:\d{1,5})?$")
    public_key: str = Field(..., pattern=HEX64)
    env: Label = Field(..., max_length=64)
    env_version: Label = Field(..., max_length=128)
    instances: int = Field(..., ge=0, le=4096)
    sessions: int = Field(..., ge=0, le=1 << 20)
    """Episodes it can hold at once (instances x sessions per instance)."""
    open_episodes: int = Field(default=0, ge=0)
    counters: dict[Label, int] = Field(default_factory=dict, max_length=32)
    """Since it started: resets, steps, instances replaced, failures by kind."""


class EnvServerInfo(Wire):
    server_id: str
    url: str
    env: str
    env_version: str
    sessions: int


class EnvLeaseInfo(Wire):
    """What an env server learns of a lease before it serves it (`GET /v1/envd/leases/{id}`)."""

    lease_id: str
    worker_id: str
    worker_public_key: str
    deadline_unix: float


class EpisodeClaim(Wire):
    server_id: Label = Field(..., max_length=64)
    lease_id: Label = Field(..., max_length=64)
    task_id: Label = Field(..., max_length=64)
    slot: int = Field(..., ge=0, le=MAX_LIST)
    env_version: Label = Field(..., max_length=128)


class EpisodeGrant(Wire):
    episode_id: str
    attempt: int
    env: str
    seed: int


class EpisodeFailed(Wire):
    server_id: Label = Field(..., max_length=64)
    episode_id: str = Field(..., pattern=EPISODE_ID)
    failure: EnvFailure
    detail: Label = Field(default="", max_length=200)
