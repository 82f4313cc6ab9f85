"""The roles' own sections: coordinator, service, worker, trainer, evaluation, monitoring, and how
the roles are launched (demo, Ray). Imports no torch."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from decentrl.config.base import Section
from decentrl.protocol import PEER_ADDRESS


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
    relay_max_body_bytes: int = Field(default=32 << 20, ge=1024)
    """Largest stage step the relay carries for holders behind NAT (a prefill's hidden states:
    batch x prompt length x hidden size x 2 bytes in bfloat16)."""
    max_transcript_bytes: int = Field(default=65_536, ge=1024)
    """Largest JSON size of a rollout's free-form fields (transcript and timings), stored as sent."""
    max_images_per_rollout: int = Field(default=8, ge=0, le=64)
    """Most images one rollout may have (a vision-language policy; docs/protocol.md, "Images")."""
    max_image_pixels: int = Field(default=1 << 22, ge=1)
    """Most pixels of all a rollout's images together (4 Mpx: a few screenshots). A task whose
    images exceed it is refused when the coordinator starts."""
    max_image_bytes: int = Field(default=4 << 20, ge=1)
    """Most bytes of the encoded images a rollout carries (images a served environment produced;
    a task's images are never sent, only named)."""
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
    max_requests_per_token: int = Field(default=16, ge=1)
    """Requests one bearer token may have in flight (its body still arriving counts); more get 503
    with Retry-After. The trainer's token, shared by the trusted roles, is exempt."""
    max_requests_per_address: int = Field(default=32, ge=1)
    """Requests without an authenticated token (registrations, unknown or junk tokens, `/metrics`)
    one client address may have in flight (not applied to `trusted_proxies`)."""
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
    stage: int | None = Field(default=None, ge=0)
    """A staged run (`model.num_stages`): the one pipeline stage this worker holds. Stage 0 drives
    leases through holders of the later stages; those serve their stage's steps (docs/pipeline.md)."""
    stage_window: int = Field(default=4, ge=1, le=64)
    """A stage holder keeps this many recent versions of its stage, so that drivers a version or
    two behind still find a route while the next one spreads."""
    stage_listen: bool = True
    """A stage holder serves drivers' steps on a port of its own (at `peer_host`). False: it opens
    no port (behind NAT or a firewall) and serves every step through the coordinator's relay. A
    holder whose port the coordinator cannot connect to is relayed too (docs/pipeline.md)."""
    state_dir: str | None = None
    """Keeps the worker's credentials and model files; default: a temp dir per process."""
    engine: Literal["hf", "vllm", "openai"] = "hf"
    """Inference engine (docs/engines.md): hf (transformers in the worker), vllm (vLLM in the worker;
    needs the `vllm` extra or .venv-vllm), openai (an OpenAI-compatible server at `openai_url` that
    the worker drives and reloads)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype of the vllm and hf engines: auto is float32 for hf, and for vllm float32 on CPU
    and bfloat16 on CUDA (an openai server's dtype is the server's own)."""
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
    """Where other workers reach the peer server, `http://IP:PORT` (no path: they build it);
    default http://peer_host:port."""
    upload_bytes_per_second: float | None = Field(default=None, gt=0)
    """Cap on the peer server's upload rate (token bucket shared by all its connections)."""
    snapshot_demand_ratio: float | None = Field(default=2.0, gt=1)
    """Ask the coordinator for a fresh snapshot (with the trainer's next version) when the cheapest
    route to the latest version costs more than this many newest-snapshot payloads; None: never."""

    @field_validator("peer_url")
    @classmethod
    def _peer_address(cls, url: str | None) -> str | None:
        if url is not None and re.fullmatch(PEER_ADDRESS, url.rstrip("/")) is None:
            raise ValueError(f"worker.peer_url {url!r} must be http://IP:PORT, e.g. http://203.0.113.7:9000")
        return None if url is None else url.rstrip("/")


class TrainerConfig(Section):
    coordinator_url: str = "http://127.0.0.1:8760"
    token: str | None = None
    """Trainer token (see `CoordinatorConfig.trainer_token`)."""
    lr: float = Field(default=1e-3, gt=0)
    """Peak learning rate of AdamW. Unset: 1e-3 with LoRA adapters (`lora.rank > 0`), 1e-4 for
    full-parameter training (`config/run.py:DEFAULT_LR` says why)."""
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
    local_groups: int = Field(default=0, ge=0, le=256)
    """Colocated mode (docs/trainer.md): groups the trainer samples itself with its own model each
    version, before training, leased and submitted to the coordinator with its token (the same
    tasks, rewards, batches and staleness accounting as workers' rollouts; no weight transfer, no
    verification). 0: every rollout comes from workers. Remote workers may contribute beside it."""
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
    pipeline_stages: int = Field(default=1, ge=1)
    """K > 1: the trainer is K stage trainers under torchrun, one rank per pipeline stage of a
    staged run (equal to its `model.num_stages`), each holding, training, checkpointing, signing
    and publishing only its stage (docs/pipeline.md, "Stage trainers"). 1: one trainer."""
    peer_host: str = "127.0.0.1"
    """Stage trainers with `weights.store = "peers"`: the address their chunk server binds (the
    stage's holders fetch its chunks there; docs/pipeline.md)."""
    peer_url: str | None = None
    """The address announced for that server (`http://IP:PORT`), when it differs from the bound one."""
    boundary_codec: Literal["float32", "bfloat16"] = "float32"
    """How stage trainers hand each other hidden states and their gradients: float32 (the update is
    the one-process update, bit for bit on CPU) or bfloat16 (half the bytes both ways; the update
    then differs by bfloat16's rounding of every activation and gradient at a boundary)."""
    pipeline_schedule: Literal["gpipe", "1f1b"] = "1f1b"
    """How stage trainers order a mini-batch's micro-batches: GPipe (every forward, then every
    backward) or 1F1B (one forward, one backward: at most K micro-batches' activations held;
    a pass of fewer micro-batches than stages runs GPipe)."""


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
    """Token of the read-only dashboard (`/dashboard#token=...`); generated and written to the run
    directory's dashboard.json when unset."""


class DemoConfig(Section):
    num_workers: int = Field(default=2, ge=0)
    """Workers the demo starts; 0 only with a colocated trainer (`trainer.local_groups > 0`)."""
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
    envd: RoleResources = RoleResources()
    """Each env server of a served task (`envd.num_servers` of them; docs/environments.md)."""
