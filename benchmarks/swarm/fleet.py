"""The simulated fleet of `decentrl bench swarm`: its configuration, its workers, the published index.

Every number that is not a protocol rule is an assumption, named here with its source, so the
reading in docs/scaling-internet.md can be checked against it. Links: log-normal downloads clipped
to 5-500 Mbit/s, uploads a fifth of that (asymmetric home links), RTT 20-300 ms. GPUs: a worker is a
node with enough GPUs of one class to hold the model in bf16; its decode speed per sequence is
memory bound (weights read once per token), so tokens/s = GPUs x bandwidth x efficiency / model
bytes, times the sequences decoded together (one lease), up to 40 % of the GPUs' peak compute. Sessions and absences are log-uniform
between minutes and hours; a share of workers sits behind NAT and cannot serve peers.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np
from pydantic import BaseModel, Field

from decentrl.protocol import WeightsEntry

MBIT = 1e6 / 8  # bytes per second in one Mbit/s


class Links(StrEnum):
    """Where the workers sit: home broadband (asymmetric) or datacenters (symmetric, gigabit)."""

    home = "home"
    datacenter = "datacenter"


# (median Mbit/s, lowest, highest, upload / download) of each link profile.
LINK_PROFILES = {Links.home: (50.0, 5.0, 500.0, 0.2), Links.datacenter: (2000.0, 500.0, 10_000.0, 1.0)}


class Training(StrEnum):
    """How the trainer changes the weights, which fixes the measured size of each delta."""

    lora = "lora"
    full = "full"


# Measured by `decentrl bench weights` (docs/weights.md), as fractions of the bf16 state: the median
# delta of consecutive versions, the catch-up patch, and a zstd snapshot. Full-parameter: lr 1e-5,
# where patches cost as much as the chain they replace and are left out.
DELTA_RATIO = {Training.lora: 0.0081, Training.full: 0.021}
PATCH_RATIO = {Training.lora: 0.0185, Training.full: None}
SNAPSHOT_RATIO = 0.757


@dataclass(frozen=True)
class GpuClass:
    name: str
    memory_gb: float
    bandwidth_gb_s: float
    tflops: float  # dense bf16 tensor throughput
    share: float


# A mixed permissionless fleet: mostly consumer cards, some datacenter nodes.
GPU_CLASSES = (
    GpuClass("RTX 3090", 24, 936, 71, 0.30),
    GpuClass("RTX 4090", 24, 1008, 165, 0.30),
    GpuClass("L40S", 48, 864, 362, 0.15),
    GpuClass("A100 80GB", 80, 2039, 312, 0.15),
    GpuClass("H100 80GB", 80, 3350, 989, 0.10),
)


class SwarmConfig(BaseModel):
    """One simulated run: fleet, protocol rules and the trainer."""

    num_workers: int = Field(default=10_000, ge=1)
    """Workers that may join the run (about half are online at any time, see the session lengths)."""
    params_billion: float = Field(default=7.0, gt=0)
    """Model size; the bf16 state is 2 bytes per parameter."""
    training: Training = Training.lora
    """Selects the measured delta and patch sizes."""
    links: Links = Links.home
    """The workers' link profile."""
    relay: bool = True
    """Workers that can serve peers relay chunks; False: every byte comes from the coordinator."""
    background_fetch: bool = False
    """False: the worker loop as it is, which loads a new version before its next lease. True: the
    worker keeps leasing on its version while that is within `max_staleness` and downloads meanwhile."""
    group_size: int = Field(default=8, ge=1)
    """Rollouts per group."""
    groups_per_lease: int = Field(default=8, ge=1)
    """Groups per lease (the worker's default); a lease's rollouts are decoded together and submitted
    as one request."""
    rollout_tokens: int = Field(default=1000, ge=1)
    """Generated tokens per rollout."""
    max_staleness: int = Field(default=4, ge=0)
    """The coordinator's rule: latest version - sampling version, at ingestion and at training."""
    step_seconds: float = Field(default=60.0, gt=0)
    """Trainer time per update; the batch is what the fleet nominally generates in that time."""
    keep_versions: int = Field(default=64, ge=1)
    """Versions whose deltas the coordinator retains (plus the newest snapshot before them)."""
    snapshot_every: int = Field(default=20, ge=1)
    """A full snapshot is published with every version divisible by this."""
    coordinator_uplink_gbit: float = Field(default=10.0, gt=0)
    """The coordinator's network uplink for chunks."""
    nat_fraction: float = Field(default=0.4, ge=0, le=1)
    """Workers behind NAT: they download but cannot serve peers."""
    new_worker_fraction: float = Field(default=0.1, ge=0, le=1)
    """Share of the workers coming online that hold no weights (new, or their state was lost); the
    others resume from the version they held. At the start everyone online holds version 0."""
    decode_efficiency: float = Field(default=0.6, gt=0, le=1)
    """Fraction of the GPUs' memory bandwidth a decode step achieves."""
    submit_bytes_per_token: float = Field(default=40.0, gt=0)
    """Bytes of JSON per generated token in a submission (id, log-prob, version)."""
    duration_seconds: float = Field(default=2400.0, gt=0)
    """Simulated time."""
    tick_seconds: float = Field(default=1.0, gt=0)
    """Time step of the fluid bandwidth model."""
    seed: int = 0
    """Seed of the fleet's random draws."""

    @property
    def state_bytes(self) -> float:
        return 2.0 * self.params_billion * 1e9


@dataclass
class Fleet:
    """Per-worker arrays drawn once per run."""

    down: np.ndarray  # bytes/s
    up: np.ndarray  # bytes/s
    rtt: np.ndarray  # seconds
    tokens_per_second: np.ndarray  # group decode throughput
    serves: np.ndarray  # bool: can serve peers
    session_seconds: np.ndarray  # mean online span
    absence_seconds: np.ndarray  # mean offline span
    gpu_names: list[str]


def _log_uniform(rng: np.random.Generator, low: float, high: float, size: int) -> np.ndarray:
    return np.exp(rng.uniform(np.log(low), np.log(high), size))


def draw_fleet(config: SwarmConfig) -> Fleet:
    rng = np.random.default_rng(config.seed)
    n = config.num_workers
    # Home: median 50 Mbit/s, sigma 1 (roughly the spread of home broadband), clipped to 5-500.
    median, lowest, highest, up_share = LINK_PROFILES[config.links]
    down_mbit = np.clip(rng.lognormal(np.log(median), 1.0, n), lowest, highest)
    classes = rng.choice(len(GPU_CLASSES), size=n, p=[c.share for c in GPU_CLASSES])
    model_gb = config.state_bytes / 1e9
    tokens_per_second = np.empty(n)
    for index, gpu in enumerate(GPU_CLASSES):
        # Enough GPUs for the weights plus 20 % for activations and the KV cache (tensor parallel).
        count = max(1, int(np.ceil(1.2 * model_gb / gpu.memory_gb)))
        per_sequence = count * gpu.bandwidth_gb_s * config.decode_efficiency / model_gb
        sequences = config.group_size * config.groups_per_lease
        # A large batch turns decoding compute bound: 2 FLOPs per parameter per token, 40 % of peak.
        compute_bound = count * gpu.tflops * 1e12 * 0.4 / (2 * config.params_billion * 1e9)
        tokens_per_second[classes == index] = min(per_sequence * sequences, compute_bound)
    return Fleet(
        down=down_mbit * MBIT,
        up=down_mbit * up_share * MBIT,
        rtt=rng.uniform(0.02, 0.3, n),
        tokens_per_second=tokens_per_second,
        serves=rng.random(n) >= config.nat_fraction,
        session_seconds=_log_uniform(rng, 600, 8 * 3600, n),
        absence_seconds=_log_uniform(rng, 600, 8 * 3600, n),
        gpu_names=[GPU_CLASSES[c].name for c in classes],
    )


def weights_index(config: SwarmConfig, latest: int) -> list[WeightsEntry]:
    """What `GET /v1/weights/index` lists at `latest`: the planner's real input."""
    state = config.state_bytes
    delta = int(DELTA_RATIO[config.training] * state)
    snapshot = int(SNAPSHOT_RATIO * state)
    patch_ratio = PATCH_RATIO[config.training]
    start = max(0, latest - config.keep_versions + 1)
    snapshots = [v for v in range(0, latest + 1, config.snapshot_every)]
    oldest = min(start, max(v for v in snapshots if v <= start))
    newest_snapshot = max(snapshots)
    entries = []
    for version in range(oldest, latest + 1):
        entries.append(WeightsEntry(version=version, kind="delta", payload_bytes=delta, state_sha256="-"))
        if version % config.snapshot_every == 0:
            entries.append(
                WeightsEntry(version=version, kind="snapshot", payload_bytes=snapshot, state_sha256="-")
            )
        if patch_ratio is None:
            continue
        # Anchors: the run's base (v0) and the newest snapshot, each at least two versions back.
        for anchor in {0, newest_snapshot}:
            if version - anchor >= 2 and anchor >= oldest:
                entry = WeightsEntry(
                    version=version,
                    kind="patch",
                    payload_bytes=int(patch_ratio * state),
                    state_sha256="-",
                    anchor=anchor,
                )
                entries.append(entry)
    return [e for e in entries if not (e.version == 0 and e.kind == "delta")]
