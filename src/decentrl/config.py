"""Typed configuration: one pydantic model per component; defaults < TOML file < CLI overrides.

The pydantic defaults are the production defaults: every role started without `--config` runs on
them. The demo's settings (a tiny model, an easy task with a flawed teacher, LoRA) live in
`decentrl/configs/demo.toml`, shipped with the package and read only by `decentrl demo` (and by
files that say `extends = "demo"`). Overrides are `section.field=value` strings, the value parsed
as TOML (so `trainer.lr=3e-4`, `demo.num_workers=3`, `model.path="/ckpt"`). Any mistake is a
`ConfigError` whose message names the fix; the CLI prints it as one line. Imports no torch.
"""

from __future__ import annotations

import json
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from decentrl.algo.config import AlgorithmConfig
from decentrl.rewards.config import RewardConfig
from decentrl.trust.tolerance import LogprobTolerance, check_bounded

DEMO_CONFIG = Path(__file__).resolve().parent / "configs" / "demo.toml"
"""The demo's settings (package data): `decentrl demo` without `--config`, and `extends = "demo"`."""


class ConfigError(ValueError):
    """A user's configuration mistake; the message says how to fix it."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class ModelConfig(Section):
    path: str | None = None
    """Local directory (or hub id when online) of a causal LM + tokenizer; None builds the tiny default."""
    hidden_size: int = Field(default=128, ge=32)
    """Tiny default only: model width. head size = hidden_size / num_heads must be >= 32 (vLLM CPU)."""
    num_layers: int = Field(default=2, ge=1)
    """Tiny default only: number of decoder layers."""
    num_heads: int = Field(default=4, ge=1)
    """Tiny default only: attention heads."""
    intermediate_size: int = Field(default=512, ge=32)
    """Tiny default only: MLP width."""
    tokenizer: Literal["char", "bpe"] = "char"
    """Tiny default only: one token per character, or a byte-level BPE trained here on generated
    text (model/bpe.py: Qwen2.5-style chat template with tool calls, two EOS ids)."""
    vocab_size: int = Field(default=4096, ge=263)
    """Tiny default with `tokenizer = "bpe"` only: size of the BPE vocabulary."""
    max_positions: int = Field(default=256, ge=16)
    """Tiny default only: longest sequence (prompt + completion) the model is built for."""
    seed: int = 0
    """Seed of the tiny model's initialisation and of its warm start."""


class TaskConfig(Section):
    env: str = "arithmetic"
    """Environment that generates tasks and scores them on the coordinator: a built-in (arithmetic,
    tool_use, code, reasoning_gym) or one registered under the `decentrl.environments` entry points."""
    args: dict[str, Any] = {}
    """Keyword arguments of the environment, e.g. `{num_digits = 2, operations = "+"}` for arithmetic."""
    eval_size: int = Field(default=256, ge=1)
    """Held-out problems for greedy evaluation."""


class SFTConfig(Section):
    steps: int = Field(default=1500, ge=0)
    """Warm-start optimizer steps (0 = start RL from the random init)."""
    batch_size: int = Field(default=64, ge=1)
    lr: float = Field(default=3e-3, gt=0)
    """Peak learning rate of the warm start (cosine to 10%)."""
    teacher_zero_pad: float = Field(default=0.0, ge=0.0, le=1.0)
    """How often the warm-start teacher zero-pads its answer ("028" for 28), a format the exact-match
    reward rejects: a habit RL must unlearn."""
    teacher_carry_drop: float = Field(default=0.0, ge=0.0, le=1.0)
    """How often the warm-start teacher forgets the carries of a sum that has them: a flawed
    teacher whose habit RL must unlearn (0 = a perfect teacher)."""
    teacher_skip_tool: float = Field(default=0.0, ge=0.0, le=1.0)
    """Tool-use tasks: how often the warm-start teacher gives up without calling the tool."""
    cache_dir: str | None = None
    """Where warm-started checkpoints are cached; default $XDG_CACHE_HOME/decentrl."""


class CoordinatorConfig(Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8760, ge=0, le=65535)
    """TCP port (0 picks a free one and writes it to the run directory)."""
    group_size: int = Field(default=8, ge=2, le=256)
    """Samples per task; advantages are normalised within a group."""
    temperature: float = Field(default=1.0, gt=0.0, le=10.0)
    """Sampling temperature leased to workers (the trainer uses the same one for log-probs)."""
    max_new_tokens: int = Field(default=8, ge=1, le=8192)
    """Generation budget per rollout."""
    max_staleness: int = Field(default=4, ge=0)
    """Largest allowed (latest version - sampling version); enforced at ingestion and by the trainer."""
    lease_seconds: float = Field(default=30.0, gt=0)
    """A lease not answered within this many seconds expires and its slots are re-leased."""
    max_pending_groups: int = Field(default=64, ge=1)
    """Groups leased or assembled but not yet trained; bounds the data the workers run ahead."""
    max_body_bytes: int = Field(default=4_000_000, ge=1024)
    """Largest accepted request body."""
    max_transcript_bytes: int = Field(default=65_536, ge=1024)
    """Largest JSON size of a rollout's free-form fields (transcript and timings), stored as sent."""
    store: str = Field(default="sqlite", pattern=r"^(sqlite|postgres(ql)?://.+)$")
    """Where the run's state lives: "sqlite" (`coordinator.db` in the run directory, one coordinator
    process) or a PostgreSQL URL `postgresql://user@host:port/database` (one database per run; several
    coordinator processes sharing the run directory may serve it; needs `decentrl[postgres]`)."""
    enroll_token: str | None = None
    """Token a worker presents to register; generated and written to the run directory when unset."""
    trainer_token: str | None = None
    """Token of the trainer; generated and written to the run directory when unset."""


class ServiceConfig(Section):
    """How the coordinator's HTTP server shares itself among clients (docs/operations.md): deadlines
    and caps that keep idle or slow sockets from starving honest workers. A reverse proxy in front
    should mirror them (its own header/idle timeouts and per-address connection limit)."""

    header_timeout_seconds: float = Field(default=10.0, gt=0)
    """A connection must deliver a complete request head this soon after opening (or after its
    previous answer's first new byte); otherwise it is closed."""
    idle_timeout_seconds: float = Field(default=15.0, gt=0)
    """A kept-alive connection with no new request for this long is closed."""
    max_connections: int = Field(default=2048, ge=16)
    """Open connections in all; past it the longest-waiting connection without a request in progress
    is closed to make room. Keep it below the process's open-file limit."""
    max_connections_per_address: int = Field(default=64, ge=1)
    """Open connections from one client address; more are closed at once. Behind a reverse proxy
    every client shares the proxy's address: raise it to the proxy's upstream connection count."""
    max_requests_in_flight: int = Field(default=256, ge=2)
    """Requests handled at once; past it, new requests are answered 503 with Retry-After."""
    scoring_concurrency: int = Field(default=4, ge=1)
    """Submissions scored at once (each holds a thread, and a code rollout a sandbox); the rest wait
    without holding a thread, so leases and health are never starved by scoring."""
    reserved_requests: int = Field(default=64, ge=0)
    """Part of `max_requests_in_flight` that only already-authenticated clients (workers whose token
    and signature passed, the trainer) may use; `/v1/health` is never refused."""
    trusted_proxies: list[str] = []
    """Addresses of reverse proxies in front of the coordinator (e.g. ["127.0.0.1"] for nginx on the
    same host): their connections are not capped per address (the proxy caps its clients), and the
    client address they send in X-Forwarded-For is the one rate limits and logs use."""
    min_free_disk_mb: int = Field(default=512, ge=0)
    """Free space the run directory's file system must keep: below it `/v1/health` reports
    unhealthy and new leases and submissions are refused with 507, before SQLite fails."""


class WorkerConfig(Section):
    coordinator_url: str = "http://127.0.0.1:8760"
    token: str | None = None
    """Enrollment token printed by the coordinator (stored in its run dir as `tokens.json`)."""
    name: str = "worker"
    state_dir: str | None = None
    """Keeps the worker's credentials and model files; default: a temp dir per process."""
    engine: Literal["hf", "vllm", "openai"] = "hf"
    """Inference engine (docs/engines.md): hf (transformers in the worker), vllm (vLLM in the worker;
    needs the `vllm` extra or .venv-vllm), openai (an OpenAI-compatible server at `openai_url` that
    the worker drives and reloads)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """vllm engine: compute dtype; auto is float32 on CPU and bfloat16 on CUDA (the hf engine
    computes in float32; an openai server's dtype is the server's own)."""
    openai_url: str | None = None
    """openai engine: base URL of the server, e.g. http://127.0.0.1:8000 (vLLM started with
    VLLM_SERVER_DEV_MODE=1 and --logprobs-mode processed_logprobs, or SGLang)."""
    openai_weights_dir: str | None = None
    """openai engine: directory the worker writes each version into and the server reloads from
    (the same path on both); default: `state_dir`/served."""
    python: str | None = None
    """Interpreter the local launcher starts workers with (a venv holding the engine, e.g.
    .venv-vllm/bin/python); default: the launcher's own."""
    device: str = "auto"
    """'auto' picks cuda, then mps, then cpu."""
    groups_per_lease: int = Field(default=8, ge=1, le=256)
    """Tasks asked for per lease; all their samples are generated in one batch."""
    num_threads: int = Field(default=1, ge=1)
    """torch CPU threads."""
    delay_seconds: float = Field(default=0.0, ge=0.0)
    """Artificial delay before each submission (simulates a slow, far-away worker)."""
    trainer_public_key: str | None = None
    """Pin the trainer's Ed25519 public key (64 hex digits, from the trainer's log or run dir); when
    unset, the key the coordinator hands out is used. Manifests not signed by it are rejected."""
    serve_peers: bool = False
    """Serve the weight chunks this worker holds to other workers (needs an inbound port; a worker
    behind NAT leaves this off and only downloads)."""
    peer_host: str = "127.0.0.1"
    """Address the peer server binds to."""
    peer_port: int = Field(default=0, ge=0, le=65535)
    """Port of the peer server (0 picks a free one)."""
    peer_url: str | None = None
    """URL other workers reach the peer server at; default http://peer_host:port."""
    upload_bytes_per_second: float | None = Field(default=None, gt=0)
    """Cap on the peer server's upload rate (token bucket shared by all its connections)."""
    snapshot_demand_ratio: float | None = Field(default=2.0, gt=1)
    """Ask the coordinator for a fresh snapshot (with the trainer's next version) when the cheapest
    route to the latest version costs more than this many newest-snapshot payloads; None: never."""


class TrainerConfig(Section):
    coordinator_url: str = "http://127.0.0.1:8760"
    token: str | None = None
    """Trainer token (see `CoordinatorConfig.trainer_token`)."""
    lr: float = Field(default=1e-3, gt=0)
    """Peak learning rate of AdamW."""
    lr_warmup_steps: int = Field(default=10, ge=0)
    """Linear warm-up from 0 to `lr` over this many versions."""
    lr_decay: Literal["constant", "cosine"] = "cosine"
    """After warm-up: keep `lr`, or decay it along a cosine to `min_lr_ratio * lr` at `num_steps`."""
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0)
    weight_decay: float = Field(default=0.0, ge=0)
    max_grad_norm: float = Field(default=1.0, gt=0)
    groups_per_step: int = Field(default=16, ge=1)
    """Groups per version (the batch that one version of the policy is trained on)."""
    minibatches_per_version: int = Field(default=4, ge=1)
    """Optimizer steps per version: the batch is cut into this many mini-batches, pi_prox is the
    policy at the start of the version, so from the second step on the clip around it is a trust
    region (verl's ppo_mini_batch_size, AReaL's ppo_n_minibatches). 1 = one step on the whole batch,
    where pi_theta = pi_prox at the gradient and every clip is inert."""
    epochs: int = Field(default=1, ge=1)
    """Passes over the version's batch, each cut into the same `minibatches_per_version`
    mini-batches: epochs x minibatches_per_version optimizer steps per version, all clipped
    around the one pi_prox scored at the start of the version (verl's ppo_epochs, AReaL's
    ppo_n_minibatches with several passes)."""
    micro_batch_tokens: int = Field(default=16384, ge=1)
    """Padded tokens (rows x longest row) per forward/backward pass; gradients accumulate over a
    mini-batch's micro-batches and every loss is divided by the mini-batch's global counts, so the
    split changes peak memory, not the update."""
    device: str = "auto"
    """Where the trainer computes: 'auto' picks cuda, then mps, then cpu; or e.g. 'cuda:1'."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Parameter dtype. auto: bfloat16 on an accelerator (with fp32 master weights and optimizer
    state), float32 on CPU."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them:
    about 1.3x the compute for a fraction of the activation memory (long sequences, big models)."""
    num_steps: int = Field(default=200, ge=1)
    """Versions published before the trainer exits."""
    num_threads: int = Field(default=1, ge=1)
    eval_every: int = Field(default=10, ge=0)
    """Greedy held-out evaluation every this many versions (0 = never)."""
    eval_size: int = Field(default=200, ge=1)
    poll_seconds: float = Field(default=0.05, gt=0)
    """Wait between polls when no batch is ready."""
    nproc: int = Field(default=1, ge=1)
    """Trainer ranks on this machine: > 1 runs the trainer under torchrun with FSDP2 (one rank per
    GPU on CUDA, gloo on CPU; docs/scaling.md). Checkpoints are then sharded and resume on any nproc."""
    max_restarts: int = Field(default=3, ge=0)
    """With nproc > 1: times torchrun restarts the whole group after a rank dies (it resumes from the
    sharded checkpoint)."""


class LoraConfig(Section):
    """Low-rank adapters instead of full-parameter training (docs/lora.md): only the adapters train,
    so a version's weight delta is about the adapters' size."""

    rank: int = Field(default=0, ge=0)
    """Adapter rank r; 0 trains every parameter (no adapters)."""
    alpha: float = Field(default=32.0, gt=0)
    """Adapter scaling numerator: the update is (alpha / rank) B A ("LoRA Without Regret" keeps 32)."""
    target_modules: str | list[str] = "all-linear"
    """`peft` target modules: "all-linear" (every linear layer of the decoder, not the head) or names."""


class TrustConfig(Section):
    """How far the coordinator trusts workers (docs/security.md): identity, bounds, verification."""

    registration: Literal["permissioned", "permissionless"] = "permissioned"
    """permissioned: registering needs the enrollment token; permissionless: anyone may register a key,
    within `registrations_per_address_per_hour`."""
    signed_requests: bool = True
    """Every worker request carries an Ed25519 signature of its method, path, body hash, timestamp and
    nonce under the key the worker registered; unsigned, forged or replayed requests get 401."""
    max_clock_skew_seconds: float = Field(default=60.0, gt=0)
    """A signed request's timestamp may differ from the coordinator's clock by at most this much."""
    requests_per_second: float = Field(default=20.0, gt=0)
    """Sustained request rate allowed per worker (and per address before authentication); over it: 429."""
    request_burst: int = Field(default=60, ge=1)
    """Requests a worker may send at once above the sustained rate."""
    registrations_per_address_per_hour: int = Field(default=20, ge=1)
    """Permissionless mode: new keys one network address may register per hour."""
    body_timeout_seconds: float = Field(default=30.0, gt=0)
    """A request body must arrive within this many seconds (slow clients get 408)."""
    verify_fraction: float = Field(default=0.1, ge=0.0, le=1.0)
    """Fraction of accepted rollouts whose log-probs a trusted verifier recomputes (0 = no verifier).
    A submission with a sampled rollout is held out of training until its verdicts arrive."""
    probation_fraction: float = Field(default=1.0, ge=0.0, le=1.0)
    """Fraction verified while a worker has fewer than `probation_tokens` verified tokens (when
    `verify_fraction` > 0): a newcomer is judged quickly, a known worker cheaply. All of it by
    default: the statistical tests need the tokens of a whole first submission to convict a
    subtle sampler there (a wrong-version claim in bf16 earns ~0.05-0.3 nats per token), and the
    probation costs about `probation_tokens` verified tokens whatever the fraction."""
    probation_tokens: int = Field(default=256, ge=0)
    """Verified tokens that end a worker's probation (copied or written completions need no verifier:
    the repeated-completion test sees them at ingestion)."""
    logprob_tolerances: dict[str, LogprobTolerance] = {}
    """Log-prob tolerances by engine class, "engine/dtype" or "engine/dtype/device" ("*" = any engine)
    -> {mean, max}, over the calibrated table (trust/tolerance.py, docs/engines.md); a worker is held to
    the entry of the class it declared at registration. No entry may exceed `tolerance.LOOSEST`."""
    max_logprob_failures: int = Field(default=1, ge=1)
    """Rollouts with a token beyond its tolerance's `max` that quarantine a worker."""
    logprob_alpha: float = Field(default=0.001, gt=0.0, lt=1.0)
    """Probability that the mean test of log-prob errors (trust/tolerance.py) ever quarantines an
    honest worker, whose expected error per token is within its tolerance's `mean`, over its life."""
    version_alpha: float = Field(default=0.001, gt=0.0, lt=1.0)
    """Probability that the version test (verifier/version_check.py: do the claimed log-probs fit the
    version before the claimed one better?) ever quarantines an honest worker over its life."""
    plausibility_alpha: float = Field(default=0.005, gt=0.0, lt=1.0)
    """Probability that the sampling-plausibility test ever quarantines an honest worker, spent over
    its whole life (trust/plausibility.py)."""
    plausibility_block_tokens: int = Field(default=512, ge=16)
    """Verified tokens per evidence block; a new block starts after that, so a worker that turns
    hostile after a long honest period is judged on recent tokens."""
    plausibility_min_tokens: int = Field(default=32, ge=1)
    """Verified tokens a block needs before its first test; it is tested again at each doubling."""
    repeat_alpha: float = Field(default=0.005, ge=0.0, lt=1.0)
    """Probability that the repeated-completion test (slots of a group that repeat each other more
    often than independent samples would; trust/repeats.py) ever quarantines an honest worker over
    its whole life; 0 turns the test off. With `plausibility_alpha`: the honest worker's bound."""
    repeat_bet: float = Field(default=0.5, gt=0.0, lt=1.0)
    """Fraction of the evidence the repeated-completion test stakes on each later slot of a group
    repeating the first (larger: faster against copy-every-slot workers, slower against partial ones)."""
    chunk_requests_per_second: float = Field(default=200.0, gt=0)
    """Sustained rate of weight-chunk downloads (`GET /v1/weights/chunks/...`) per worker, counted
    apart from `requests_per_second` so that catching up on a version never starves leases."""
    chunk_request_burst: int = Field(default=2000, ge=1)
    """Chunk downloads a worker may make at once above the sustained rate (a full snapshot)."""
    scoring_seconds_per_second: float = Field(default=0.5, gt=0)
    """Scoring time (episode replay, sandboxed code) a worker's submissions may cost the coordinator
    per second on average; past it, submissions get 429 until the budget refills."""
    scoring_burst_seconds: float = Field(default=30.0, gt=0)
    """Scoring time a worker may spend at once above the average (a few slow code rollouts)."""
    lease_groups_floor: int = Field(default=16, ge=1)
    """Open (leased, unanswered) groups any worker may hold; above it, only as many as twice the
    groups' worth of rollouts it delivered in the last `coordinator.lease_seconds`."""
    max_violations: int = Field(default=5, ge=1)
    """Hostile protocol violations (bad signature, replay, prompt swap, foreign lease, out-of-vocabulary
    ids, sampling mismatch, ...) that quarantine a worker."""
    verification_seconds: float = Field(default=60.0, gt=0)
    """A verification job a verifier took but did not answer within this time is handed out again."""

    @field_validator("logprob_tolerances")
    @classmethod
    def _bounded(cls, entries: dict[str, LogprobTolerance]) -> dict[str, LogprobTolerance]:
        check_bounded(entries)
        return entries


class WeightsConfig(Section):
    """How the trainer publishes weights and the coordinator keeps them (docs/weights.md)."""

    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Inference dtype of published weights; deltas are taken between consecutive published states."""
    snapshot_every: int = Field(default=20, ge=1)
    """A full snapshot is published with every version divisible by this (and with version 0)."""
    chunk_bytes: int = Field(default=4 << 20, ge=1024)
    """Size of the content-addressed chunks a version's payload is cut into."""
    keep_versions: int = Field(default=64, ge=1)
    """The coordinator keeps the manifests and chunks of the newest this many versions, plus the
    newest snapshot before them, so that every retained version stays reachable."""
    min_snapshot_interval: int = Field(default=8, ge=1)
    """A snapshot asked for by workers comes at most every this many versions, however many ask (a
    request with the trainer token, an operator's, is answered with the next version)."""
    snapshot_requests_per_hour: int = Field(default=60, ge=1)
    """Snapshot requests one worker may make per hour; more get 429."""
    upload_bytes_per_second: float | None = Field(default=None, gt=0)
    """Cap on the coordinator's chunk upload rate (token bucket over all connections); None: no cap."""
    patch_max_fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    """Catch-up patches (docs/weights.md): each version also gets a patch against the run's base and
    the newest snapshot while its payload is below this fraction of the snapshot's; 0 turns them off."""


class SandboxConfig(Section):
    """Isolation of untrusted code (docs/sandbox.md): which backend, and the limits of one run."""

    backend: Literal["bubblewrap", "none"] = "bubblewrap"
    """bubblewrap: Linux namespaces via the `bwrap` binary (apt-get install bubblewrap); none: refuse
    to run untrusted code at all (never a silent unsandboxed fallback)."""
    python: str = "/usr/bin/python3"
    """Interpreter run inside the sandbox (only /usr is mounted there, so it must live under /usr)."""
    uid: int = Field(default=65534, ge=1)
    """Unprivileged host uid the sandbox runs as when the caller is root (65534 = nobody): root
    ignores RLIMIT_NPROC, so a fork bomb is only bounded under a real non-root uid."""
    cpu_seconds: int = Field(default=5, ge=1)
    """RLIMIT_CPU of each process: SIGXCPU at this many CPU seconds, SIGKILL one second later."""
    wall_seconds: float = Field(default=10.0, gt=0)
    """Wall-clock limit of a run; past it the whole sandbox (every process in its PID namespace) is
    killed."""
    address_space_mb: int = Field(default=512, ge=64)
    """RLIMIT_AS of each process: larger allocations fail with MemoryError."""
    file_size_mb: int = Field(default=16, ge=1)
    """RLIMIT_FSIZE: largest file a process may write."""
    open_files: int = Field(default=64, ge=16)
    """RLIMIT_NOFILE: open file descriptors per process."""
    processes: int = Field(default=16, ge=2)
    """RLIMIT_NPROC, counted per sandbox (processes and threads): the fork-bomb bound."""
    tmpfs_mb: int = Field(default=64, ge=1)
    """Size of the private in-memory work directory (/tmp, the only writable path)."""
    max_output_bytes: int = Field(default=1_000_000, ge=1024)
    """Captured stdout and stderr, each; a run that prints more is killed."""


class EvalConfig(Section):
    """`decentrl eval` (docs/monitoring.md): held-out scores of a model, a run's version or an endpoint."""

    num_problems: int | None = Field(default=None, ge=1)
    """Held-out problems (the first of the environment's eval split); None: `task.eval_size`."""
    num_samples: int = Field(default=8, ge=0)
    """k: sampled episodes per problem for pass@k and avg@k (0 = greedy pass@1 only)."""
    temperature: float = Field(default=1.0, gt=0.0, le=10.0)
    """Sampling temperature of the k samples (greedy pass@1 uses none)."""
    batch_size: int = Field(default=256, ge=1)
    """Episodes generated together."""
    confidence: float = Field(default=0.95, gt=0.0, lt=1.0)
    """Two-sided level of the reported intervals."""
    seed: int = 0
    """Seed of the samples."""
    engine: Literal["hf", "openai"] = "hf"
    """hf: the model in this process (`transformers`); openai: an OpenAI-compatible completions
    endpoint (vLLM, SGLang, ...) at `endpoint` (a URL given to `decentrl eval` selects it)."""
    endpoint: str | None = None
    """Base URL of the OpenAI-compatible server, e.g. http://host:8000/v1."""
    endpoint_model: str | None = None
    """Model name sent to the endpoint; None: the first one its /models lists."""
    device: str | None = None
    """hf engine: where to compute, e.g. 'cpu' or 'cuda:1'; None: the trainer's device
    (`trainer.device`). The dtype is always `trainer.dtype`."""


class MonitorConfig(Section):
    """Where a run's metrics go besides `/metrics` and the dashboard (docs/monitoring.md)."""

    trackers: list[Literal["tensorboard", "wandb"]] = []
    """Experiment trackers fed with the trainer's step metrics and the coordinator's run statistics;
    wandb runs offline unless WANDB_MODE says otherwise."""
    log_dir: str | None = None
    """Where tracker files go; default run_dir/trackers."""
    project: str = "decentrl"
    """W&B project name."""
    stats_every_seconds: float = Field(default=5.0, gt=0)
    """How often the coordinator's run statistics are logged to the trackers."""
    inspect_rollouts: int = Field(default=8, ge=0, le=256)
    """Trained rollouts per step whose trainer log-probs are sent to the coordinator for the
    dashboard's inspector (their pi_prox log-probs, computed for the loss anyway; 0 = none)."""
    dashboard_token: str | None = None
    """Token of the read-only dashboard (`/dashboard?token=...`); generated and written to the run
    directory's tokens.json when unset."""


class DemoConfig(Section):
    num_workers: int = Field(default=2, ge=1)
    run_dir: str | None = None
    """Default runs/<timestamp>/."""
    live: bool = True
    """Show the live progress view (off when stdout is not a terminal)."""
    export: bool = True
    """End by exporting the last version as a Hugging Face model directory (run_dir/model) with
    its model card, evaluated with `[eval]` (docs/release.md)."""


class RoleResources(Section):
    """What Ray reserves for one actor of a role (docs/scaling.md)."""

    num_cpus: float = Field(default=1.0, ge=0)
    num_gpus: float = Field(default=0.0, ge=0)
    """GPUs of the actor; the trainer's should be trainer.nproc (one per rank)."""


class RayConfig(Section):
    """`decentrl launch ray`: every role as a Ray actor (docs/scaling.md)."""

    address: str | None = None
    """Ray cluster to join ('auto', 'HOST:6379' or 'ray://HOST:10001'); None starts a local one."""
    num_cpus: int | None = None
    """Local cluster only: CPUs it may schedule (default: the machine's)."""
    include_dashboard: bool = False
    """Local cluster only: start Ray's dashboard (about 150 MB and a few processes more)."""
    num_workers: int = Field(default=2, ge=0)
    """Rollout workers started as actors; each is restarted when it dies."""
    coordinator_node: str | None = None
    """IP address of the node that keeps the coordinator and its run directory; default: this one."""
    coordinator: RoleResources = RoleResources()
    trainer: RoleResources = RoleResources()
    verifier: RoleResources = RoleResources()
    scorer: RoleResources = RoleResources()
    """Each reward-model scorer (one per `reward_model` term); give it a GPU to score on CUDA."""
    worker: RoleResources = RoleResources()


class RunConfig(Section):
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    sft: SFTConfig = SFTConfig()
    coordinator: CoordinatorConfig = CoordinatorConfig()
    service: ServiceConfig = ServiceConfig()
    worker: WorkerConfig = WorkerConfig()
    trainer: TrainerConfig = TrainerConfig()
    lora: LoraConfig = LoraConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    demo: DemoConfig = DemoConfig()
    ray: RayConfig = RayConfig()
    sandbox: SandboxConfig = SandboxConfig()
    weights: WeightsConfig = WeightsConfig()
    trust: TrustConfig = TrustConfig()
    reward: RewardConfig = RewardConfig()
    eval: EvalConfig = EvalConfig()
    monitor: MonitorConfig = MonitorConfig()
    seed: int = 0
    """Seed of the task stream and of sampling."""


SECRET_FIELDS = {
    "worker": {"token", "coordinator_url", "state_dir"},
    "trainer": {"token", "coordinator_url"},
    "coordinator": {"enroll_token", "trainer_token"},
    "monitor": {"dashboard_token"},
}
"""Fields left out wherever a config is shown to others (model cards, experiment trackers)."""


def _parse_override(text: str) -> tuple[list[str], object]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.field=value, e.g. trainer.lr=3e-4")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare strings need no quotes: model.path=/some/dir
    return key.strip().split("."), value


def _set_path(tree: dict, path: list[str], value: object) -> None:
    node = tree
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"'{'.'.join(path)}': '{part}' is a value, not a section")
    node[path[-1]] = value


def _describe(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"] if not _is_variant_tag(p, first["loc"]))
    if first["type"] == "extra_forbidden":
        section = _section_of(first["loc"][:-1])
        valid = ", ".join(sorted(section.model_fields)) if section else ""
        return f"unknown config key '{where}'; valid keys here: {valid}"
    if first["type"] == "union_tag_invalid":
        context = first.get("ctx", {})
        return f"config '{where}': {context.get('tag')!r} is not a known name; choose one of {context.get('expected_tags')}"
    return f"config '{where}': {first['msg']} (got {first.get('input')!r})"


def _is_variant_tag(part: object, loc: tuple) -> bool:
    """True for the variant name pydantic inserts into the location of a discriminated union."""
    index = loc.index(part)
    return index > 0 and _section_of(loc[:index]) is None and _section_of(loc[: index + 1]) is not None


def _section_of(loc: tuple) -> type[BaseModel] | None:
    """The model at `loc`; a discriminated union (the algorithm variants) is resolved by the tag
    pydantic puts in the location after the field name."""
    model: type[BaseModel] = RunConfig
    parts = list(loc)
    while parts:
        field = model.model_fields.get(str(parts.pop(0)))
        if field is None:
            return None
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            model = field.annotation
            continue
        variants = {v.model_fields["name"].default: v for v in typing.get_args(field.annotation)}
        if not parts or parts[0] not in variants:
            return None
        model = variants[parts.pop(0)]
    return model


def _read_tree(path: Path | None, seen: tuple[Path, ...] = ()) -> tuple[str, dict]:
    if path is None:
        return "defaults", {}
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found; pass an existing .toml or omit --config")
    try:
        # JSON is accepted too: launchers hand each role the exact resolved config that way.
        text = path.read_text()
        tree = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"{path}: invalid {path.suffix[1:].upper()} ({exc}); fix the file's syntax"
        ) from None
    base = tree.pop("extends", None)
    if base is None:
        return path.name, tree
    # `extends = "../base.toml"`: start from another file (relative to this one), then this file's
    # keys; `extends = "demo"` names the demo config shipped with the package.
    base_path = DEMO_CONFIG if base == "demo" else (path.parent / str(base)).resolve()
    if base_path in seen or base_path == path.resolve():
        raise ConfigError(f"{path}: 'extends' makes a cycle through {base_path}; remove one of them")
    _, base_tree = _read_tree(base_path, (*seen, path.resolve()))
    return path.name, _merge(base_tree, tree)


def _merge(base: dict, top: dict) -> dict:
    """`top` over `base`, section by section; a variant whose `name` changes replaces the base's."""
    merged = dict(base)
    for key, value in top.items():
        old = merged.get(key)
        same_variant = not (isinstance(old, dict) and isinstance(value, dict)) or old.get(
            "name"
        ) == value.get("name", old.get("name"))
        if isinstance(old, dict) and isinstance(value, dict) and same_variant:
            merged[key] = _merge(old, value)
        else:
            merged[key] = value
    return merged


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Defaults < the file at `path` (none when None) < overrides."""
    name, tree = _read_tree(Path(path) if path is not None else None)
    for text in overrides or []:
        key, value = _parse_override(text)
        _set_path(tree, key, value)
    _name_default_variants(tree, RunConfig)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(f"{name}: {_describe(exc)}") from None


def _name_default_variants(tree: dict, model: type[BaseModel]) -> None:
    """A variant section set without its `name` (`--set algorithm.correction.cap=3` on the
    defaults) refers to the default variant: fill in that variant's name."""
    for key, field in model.model_fields.items():
        value = tree.get(key)
        if not isinstance(value, dict):
            continue
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            _name_default_variants(value, field.annotation)
        elif isinstance(field.default, BaseModel) and "name" in type(field.default).model_fields:
            value.setdefault("name", field.default.model_dump()["name"])  # checked just above


def dump_toml(tree: dict, prefix: str = "") -> str:
    """`tree` (a JSON-like dump of a config) as TOML that `load_config` reads back to the same
    values: a table's plain values first, then its sub-tables as `[section.sub]` headers."""
    lines = [f"{key} = {_toml_value(value)}" for key, value in tree.items() if not _is_table(value)]
    for key, value in tree.items():
        if _is_table(value):
            name = f"{prefix}{key}"
            lines += ["", f"[{name}]", dump_toml(value, name + ".")]
    return "\n".join(line for line in lines if line != "" or lines).strip("\n")


def _is_table(value: object) -> bool:
    return isinstance(value, dict) and bool(value)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):  # an inline table (an empty one, or one inside a list)
        return "{" + ", ".join(f"{key} = {_toml_value(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    return json.dumps(value)  # numbers, and strings in TOML's basic-string syntax


COORDINATOR_SECTIONS = ("model", "task", "sft")
"""Sections a trainer or verifier takes from the coordinator's `/v1/info`: what the run trains
(the model, or the recipe of the tiny one and its warm start) and on which task."""


def adopt_coordinator_sections(config: RunConfig, sections: dict[str, dict], role: str) -> RunConfig:
    """`config` with the coordinator's model, task and warm-start sections. A section the role
    left at its defaults is taken as the coordinator has it; one set to something else is a
    ConfigError naming the difference (two parts of one run must agree on what they train)."""
    update = {}
    for name in COORDINATOR_SECTIONS:
        if name not in sections:
            continue
        section_type = type(getattr(config, name))
        theirs = section_type.model_validate(sections[name])
        ours = getattr(config, name)
        if ours != theirs and ours != section_type():
            differing = [
                f"{name}.{key} = {getattr(ours, key)!r} (coordinator: {getattr(theirs, key)!r})"
                for key in section_type.model_fields
                if getattr(ours, key) != getattr(theirs, key)
            ]
            raise ConfigError(
                f"the {role}'s [{name}] differs from the coordinator's: {'; '.join(differing[:3])}; "
                f"drop [{name}] from the {role}'s config or start it with the coordinator's"
            )
        update[name] = theirs
    return config.model_copy(update=update)
