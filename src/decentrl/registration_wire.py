"""Wire types of joining a run: a worker's registration (and the challenge its key signs) and what
every client reads about the run (`GET /v1/info`; docs/protocol.md, "Routes").

Part of the wire types `protocol.py` gathers; imports neither torch nor any role.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from decentrl.rollout_wire import SamplingParams
from decentrl.stage_map import StageMap
from decentrl.wire import Label, Wire

DeclaredDtype = Literal["float32", "bfloat16", "float16", "unknown"]
DeclaredDevice = Literal["cpu", "cuda", "mps", "unknown"]


class RegisterRequest(Wire):
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    engine: Label = Field(default="hf", max_length=32)
    dtype: DeclaredDtype = "float32"
    """The dtype the engine computes in ("unknown": a server whose dtype the worker was not told)."""
    device: DeclaredDevice = "cpu"
    """Where the engine computes; with `engine` and `dtype`, the class whose log-prob tolerance the
    verifier's checks hold this worker to (trust/logprob_tolerance.py)."""
    public_key: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    """Hex of the worker's raw 32-byte Ed25519 public key; it must sign every later request
    (required when the coordinator's `trust.signed_requests` is on)."""
    challenge: Label | None = Field(default=None, max_length=128)
    """A challenge from `POST /v1/workers/challenge` (required with `public_key`)."""
    proof: str | None = Field(default=None, pattern=r"^[0-9a-f]{128}$")
    """Hex Ed25519 signature of `identity.registration_message(challenge, public_key)`: proves that
    the registrant holds the private key (required with `public_key`)."""


class Challenge(Wire):
    challenge: str
    """Sign it with the key being registered; valid for a few minutes and only once."""
    server_time: float


class RegisterResponse(Wire):
    worker_id: str
    token: str
    """Bearer token for every later request of this worker."""


class ServerInfo(Wire):
    """What any client needs to know about the run (`GET /v1/info`)."""

    run_id: str
    vocab_size: int
    eos_token_ids: list[int] = Field(..., min_length=1)
    """Every id that ends a generation (the model's config.json and generation_config.json
    together), end of turn first; an engine stops at any of them."""
    pad_token_id: int
    group_size: int
    max_staleness: int
    sampling: SamplingParams
    latest_version: int | None
    model_files: list[str]
    """Non-weight files (config, tokenizer) a worker downloads from `/v1/model/files/{name}`."""
    trainer_public_key: str | None = None
    """Hex Ed25519 key that signs weight manifests (None until the trainer registered it)."""
    stage_keys: list[str | None] | None = None
    """A run of stage trainers: the key that signs each stage's manifests, by stage (None until
    that stage trainer registered it); `trainer_public_key` is then None."""
    env_args: dict = Field(default_factory=dict)
    """Keyword arguments of the run's environment (`task.args`); a worker loads the environment
    named by each `TaskSpec.env` with them to play multi-turn episodes."""
    logprob_tolerances: dict[str, dict[str, float]] = Field(default_factory=dict)
    """The run's log-prob tolerance per engine class ("engine/dtype[/device]" -> {mean, max};
    trust/logprob_tolerance.py): a worker is held to the entry of the class it registered with."""
    sections: dict[str, dict] = Field(default_factory=dict)
    """The run's `model`, `task` and `sft` config sections: a trainer or verifier takes them
    (or refuses to start with different ones)."""
    stage_map: StageMap | None = None
    """The run's pipeline stages (`model.num_stages` over the model's config.json): every weight
    manifest is split by it and a stage holder fetches only its stage. None: not staged."""
