"""Wire types of the weights' distribution: the published versions, the keys that sign them and
the chunk servers that hold them (docs/protocol.md, "Weights"; docs/weights.md).

A trainer (or each stage trainer) registers the key its manifests are signed with; the coordinator
lists the versions it keeps and their manifests for a catch-up planner; workers, and stage trainers
with `weights.store = "peers"`, announce where they serve chunks, and a worker reports a peer whose
chunk did not hash to its name. Part of the wire types `protocol.py` gathers; imports neither torch
nor any role.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from decentrl.wire import MAX_VERSION, Label, Wire

PEER_ADDRESS = r"^https?://(\d{1,3}(\.\d{1,3}){3}|\[[0-9a-fA-F:.]{2,45}\]):\d{1,5}$"
"""A peer's chunk server: scheme, IP address and port, nothing else. The fetching worker builds the
path itself (`/chunks/{sha256}`), so an announcement cannot steer it at any other path or query."""


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
