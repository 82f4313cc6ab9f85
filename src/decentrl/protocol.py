"""Wire types shared by every role (see docs/protocol.md).

Everything that crosses the network is one of these pydantic models. They are strict
(`extra="forbid"`) so a malformed or padded body is a 422 with a message, never a silent
partial parse. This module imports neither torch nor any role.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from decentrl.envd_wire import ServedEpisode
from decentrl.image_wire import MAX_ROLLOUT_IMAGES, RolloutImage
from decentrl.stage_map import StageMap
from decentrl.wire import MAX_LIST, MAX_VERSION, Label, Wire

API_PREFIX = "/v1"
SERVER_TIME_HEADER = "X-Decentrl-Server-Time"
"""Sent with a 401 for a signature timestamp outside the coordinator's window: its clock, so that the
client can correct its own and sign again."""


PEER_ADDRESS = r"^https?://(\d{1,3}(\.\d{1,3}){3}|\[[0-9a-fA-F:.]{2,45}\]):\d{1,5}$"
"""A peer's chunk server: scheme, IP address and port, nothing else. The fetching worker builds the
path itself (`/chunks/{sha256}`), so an announcement cannot steer it at any other path or query."""

__all__ = ["MAX_LIST", "MAX_VERSION", "Label", "Wire"]  # the base types, kept importable from here


class SamplingParams(Wire):
    """How a worker must sample; leased by the coordinator and echoed back with each rollout."""

    temperature: float = Field(default=1.0, ge=0.0, le=10.0)
    max_new_tokens: int = Field(default=16, ge=1, le=MAX_LIST)
    max_context: int | None = Field(default=None, ge=2, le=1 << 24)
    """The model's context length: the prompt, every model turn and every environment turn of an
    episode fit in it (`envs/episode.py`). None: the model does not say (no bound beyond the budget)."""


# ---------------------------------------------------------------- registration

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


# ---------------------------------------------------------------- training


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


class WeightsInfo(Wire):
    version: int
    sha256: str
    """Hash of the version's reconstructed state (`weights.codec.state_hash`)."""
    num_bytes: int
    """Payload bytes of the manifest that first published this version."""
    created_unix: float


class WeightsEntry(Wire):
    """One retained manifest, as listed by `GET /v1/weights/index` for the catch-up planner."""

    version: int
    kind: Literal["snapshot", "delta", "patch"]
    payload_bytes: int
    state_sha256: str
    anchor: int | None = None
    """A patch applies to any held version in [anchor, version); None for snapshots and deltas."""
    stage_bytes: list[int] | None = None
    """Payload bytes of each stage's section (a staged run): what a stage holder downloads."""
    stage: int | None = None
    """A stage trainer's manifest: the one stage it carries (fetched with `?stage=`)."""


class TrainerKey(Wire):
    public_key: str = Field(..., pattern=r"^[0-9a-f]{64}$")
    """Hex of the trainer's raw Ed25519 public key."""
    stage: int | None = Field(default=None, ge=0, le=1023)
    """A stage trainer's key: the stage whose manifests it signs (`trainer.pipeline_stages`)."""


class PeerAnnounce(Wire):
    url: str = Field(..., max_length=64, pattern=PEER_ADDRESS)
    """Where this worker serves `GET /chunks/{sha256}` to other workers: `http://IP:PORT`."""
    version: int = Field(..., ge=-1, le=MAX_VERSION)
    """The version it holds now (-1: none yet); never above the latest published one."""


class TrainerPeerAnnounce(Wire):
    """A stage trainer's chunk server (`weights.store = "peers"`): where its stage's chunks are."""

    stage: int = Field(..., ge=0, le=1023)
    url: str = Field(..., max_length=64, pattern=PEER_ADDRESS)
    version: int = Field(..., ge=-1, le=MAX_VERSION)
    """The newest version it published (-1: none yet)."""


class PeerInfo(Wire):
    worker_id: str
    url: str = Field(..., max_length=64, pattern=PEER_ADDRESS)
    version: int
    established: bool = False
    """Past its probation (`trust.probation_tokens` verified tokens): a sybil made to crowd the list
    is not, so fetchers ask established peers first."""
    seeder: bool = False
    """A stage trainer serving its stage's chunks (`weights.store = "peers"`): where a new version
    first exists, so a fetcher never gives up on it for being slow or briefly unreachable."""


class PeerReport(Wire):
    """A worker reports a peer that served a chunk whose bytes did not hash to its name."""

    worker_id: Label = Field(..., max_length=64)
    sha256: str = Field(..., pattern=r"^[0-9a-f]{64}$")
    reason: Label = Field(..., max_length=200)


# ---------------------------------------------------------------- verification (trusted verifier)


class VerifyJobsRequest(Wire):
    max_jobs: int = Field(default=16, ge=1, le=1024)
    dtype: DeclaredDtype = "float32"
    """The verifier's compute dtype: a job's tolerance is the looser of its worker's engine class
    and this dtype's (a bf16 recomputation errs like a bf16 engine)."""


class VerifyJob(Wire):
    """One accepted rollout whose claims a trusted verifier recomputes (docs/security.md)."""

    rollout_id: str
    temperature: float
    prompt_token_ids: list[int]
    segments: list[Segment]
    """As submitted: every model token carries the version it claims to come from."""
    pit_seed: int
    """Seed of the randomised probability integral transform; unknown to the worker."""
    stage_traces: list[StageTrace] | None = None
    """A staged rollout's traces: the verifier recomputes each stage on its committed inputs and
    blames the first whose answer diverges."""
    stage_map: StageMap | None = None
    tolerance_mean: float = Field(default=0.002, gt=0.0)
    """The mean log-prob error per token allowed (the worker's engine class's, or the verifier's
    dtype's if looser): the null of the mean test whose log-evidence the verifier reports
    (trust/logprob_tolerance.py)."""
    images: list[RolloutImage] | None = None
    """The rollout's images as accepted; the verifier draws them from `seed`."""
    seed: int | None = None
    """The task's seed, sent with images."""


class VerifyJobs(Wire):
    jobs: list[VerifyJob]


class Verdict(Wire):
    """What the verifier measured for one rollout; the coordinator decides what it means."""

    rollout_id: Label = Field(..., max_length=64)
    num_tokens: int = Field(default=0, ge=0)
    max_logprob_error: float = Field(default=0.0, ge=0.0)
    """max over model tokens of |claimed - recomputed| log-prob under the claimed version."""
    mean_logprob_error: float = Field(default=0.0, ge=0.0)
    """Mean over the compared model tokens of |claimed - recomputed| log-prob."""
    logprob_tokens: int = Field(default=0, ge=0)
    """Model tokens compared (greedy ones too; `num_tokens` counts the sampled ones of `pit_sums`)."""
    error_log_evidence: float = Field(default=0.0, allow_inf_nan=False)
    """Sum over the compared tokens of log(1 + bet (min(error, CLIP) - tolerance_mean)): the mean
    test's evidence from this rollout (trust/logprob_tolerance.py)."""
    pit_sums: list[float] = Field(default_factory=list, max_length=8)
    """Sums over model tokens of the orthonormal Legendre polynomials 1..k of the randomised PIT value
    (uniform on [0, 1] for honestly sampled tokens)."""
    unverifiable: str | None = Field(default=None, max_length=200)
    """Why the rollout could not be checked (e.g. its version's weights were pruned)."""
    version_tokens: int = Field(default=0, ge=0)
    """Model tokens also recomputed under the version before the one they claim."""
    version_log_evidence: float = Field(default=0.0, allow_inf_nan=False)
    """The version test's log-evidence from those tokens: high when the previous version explains
    the claimed log-probs better than the claimed one (verifier/version_check.py)."""
    blame_stage: int | None = Field(default=None, ge=0, le=1024)
    """A staged rollout: the first stage whose answer on its committed inputs diverged from the
    recomputation (0: the driver's own stage); None when every stage agreed."""
    blame_detail: str | None = Field(default=None, max_length=200)


class VerdictBatch(Wire):
    verdicts: list[Verdict] = Field(..., max_length=1024)
    compute_seconds: float = Field(default=0.0, ge=0.0)
    """Verifier compute spent on these verdicts (forward passes), for the overhead metric."""
    dtype: DeclaredDtype = "float32"
    """The verifier's compute dtype (as in `VerifyJobsRequest`)."""


# ---------------------------------------------------------------- reward scoring (trusted scorer)


class ScoreJobsRequest(Wire):
    max_jobs: int = Field(default=64, ge=1, le=1024)
    term: Label | None = Field(default=None, max_length=64)
    """Only jobs of this rubric term (a scorer serves one reward model); None: any term."""


class ScoreJob(Wire):
    """One accepted rollout a trusted scorer (`decentrl scorer`) scores with its reward model."""

    rollout_id: str
    term: str
    """The rubric term (`[[reward.terms]]` label) the score is for."""
    prompt: str
    """The problem's prompt as text (chat prompts: the last message's content)."""
    answer: str
    """The final assistant turn, decoded from the rollout's token ids by the coordinator."""


class ScoreJobs(Wire):
    jobs: list[ScoreJob]


class TermScore(Wire):
    rollout_id: Label = Field(..., max_length=64)
    term: Label = Field(..., max_length=64)
    value: float = Field(..., allow_inf_nan=False)


class TermScoreBatch(Wire):
    scores: list[TermScore] = Field(..., max_length=1024)
    compute_seconds: float = Field(default=0.0, ge=0.0)


class ErrorBody(Wire):
    detail: str
