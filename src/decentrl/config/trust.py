"""What the run trusts and how it checks it: workers (`[trust]`), the published weights
(`[weights]`) and the sandbox that runs untrusted code (`[sandbox]`). Imports no torch."""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import Field, field_validator, model_validator

from decentrl.config.base import Section
from decentrl.trust.logprob_tolerance import LOOSEST, LogprobTolerance, check_bounded


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
    failed_auths_per_address_per_minute: int = Field(default=30, ge=1)
    """Requests with a wrong token (worker, enrollment or trainer) one address may send per minute,
    a tenth of them (at least 10) at once; past it, every request from it with a token not yet
    authenticated gets 429, a second late, before any lookup."""
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
    -> {mean, max}, over the calibrated table (trust/logprob_tolerance.py, docs/engines.md); a worker is held to
    the entry of the class it declared at registration. No entry may exceed `loosest_tolerance`."""
    loosest_tolerance: LogprobTolerance = LOOSEST
    """The cap on every entry, shipped or configured (mean 0.03, max 10 by default): what a worker
    that declares another engine class than its own can gain at most. Raise it only for a model whose
    honest engines err by more (calibrate with `decentrl bench engines --pretrained DIR`): every
    worker can then bias its log-probs by up to the new mean undetected (docs/security.md)."""
    max_logprob_failures: int = Field(default=1, ge=1)
    """Rollouts with a token beyond its tolerance's `max` that quarantine a worker."""
    logprob_alpha: float = Field(default=0.001, gt=0.0, lt=1.0)
    """Probability that the mean test of log-prob errors (trust/logprob_tolerance.py) ever quarantines an
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
    relay_requests_per_second: float = Field(default=500.0, gt=0)
    """Sustained rate of relayed stage steps (`/v1/relay/...`) per worker, counted apart from
    `requests_per_second`: a driver posts one per decode step and hop, a holder one exchange per
    step it serves."""
    relay_request_burst: int = Field(default=1000, ge=1)
    """Relayed stage steps a worker may send at once above the sustained rate."""
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
    lease_groups_new: int = Field(default=8, ge=1)
    """Open (leased, unanswered) groups a worker that has delivered nothing may hold; each group's
    worth of rollouts accepted from it raises this by one, up to `lease_groups_floor`."""
    lease_groups_floor: int = Field(default=16, ge=1)
    """Open groups a worker that has delivered may hold; above it, only as many as twice the groups'
    worth of rollouts it delivered in the last `coordinator.lease_seconds`. Every cap is bounded by
    a fair share of `coordinator.max_pending_groups` among the workers holding leases."""
    max_violations: int = Field(default=5, ge=1)
    """Hostile protocol violations (bad signature, replay, prompt swap, foreign lease, out-of-vocabulary
    ids, sampling mismatch, ...) that quarantine a worker."""
    verification_seconds: float = Field(default=60.0, gt=0)
    """A verification job a verifier took but did not answer within this time is handed out again."""

    @model_validator(mode="after")
    def _bounded(self) -> TrustConfig:
        loosest = self.loosest_tolerance
        if loosest.mean < LOOSEST.mean or loosest.max < LOOSEST.max:
            raise ValueError(
                f"trust.loosest_tolerance ({loosest.mean}, {loosest.max}) is below the shipped cap "
                f"({LOOSEST.mean}, {LOOSEST.max}), which the calibrated bfloat16 entry needs; tighten an "
                "engine class with trust.logprob_tolerances instead"
            )
        check_bounded(self.logprob_tolerances, loosest)
        return self


LOOPBACK_NETWORKS = ["127.0.0.0/8", "::1/128"]
"""`weights.peer_networks` of a run whose workers all serve chunks on one machine's loopback."""


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
    store: Literal["coordinator", "peers"] = "coordinator"
    """Where chunks live. coordinator: it stores and serves every chunk of every retained version.
    peers: it keeps manifests, hashes, signatures and peer lists only, and never a chunk; the
    stage trainers serve their stages' chunks and the holders relay them (a run of stage
    trainers, `trainer.pipeline_stages > 1`; docs/pipeline.md)."""
    peer_networks: list[str] = []
    """Networks (CIDRs, e.g. "10.0.0.0/8") whose addresses workers may announce as chunk servers
    besides globally routable ones: a private fleet's own network. Empty: public addresses only,
    so no announcement sends other workers to an internal address (the local launcher adds
    loopback for the workers it starts on this machine)."""

    @field_validator("peer_networks")
    @classmethod
    def _networks(cls, networks: list[str]) -> list[str]:
        for network in networks:
            try:
                ipaddress.ip_network(network)
            except ValueError as exc:
                raise ValueError(f"weights.peer_networks: {exc} (write a CIDR such as 10.0.0.0/8)") from None
        return networks


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
