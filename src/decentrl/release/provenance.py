"""Where an exported model comes from, as facts the trainer's key signs.

`provenance/provenance.json` in an export holds: the run, the exported version and its state hash,
the trainer's public key, the signed manifests of the route that rebuilds the version (a snapshot,
then deltas or a patch; `provenance/manifests/`), the state hash of every version the run
published, what the coordinator counted (workers, rollouts accepted, trained, rejected,
quarantines), the training config (secrets left out, passwords masked), the evaluation, and the
SHA-256 of every other file of the directory (weights, config, tokenizer, chat template, ...).
`provenance/provenance.sig` is the trainer key's Ed25519 signature of those exact bytes
(release/signature.py), and the model card is rendered from them alone (release/card.py).
`provenance/state.safetensors` is the published state itself (inference dtype, LoRA adapters
unmerged): its hash is the one the trainer signed in the manifests, and merging it gives the
model's weights (`decentrl verify-release` checks both).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, field_validator

from decentrl.dbapi import Connection
from decentrl.weights.manifest import Manifest
from decentrl.weights.run_dir import RunWeights, read_only, rows

DIRECTORY = "provenance"
STATE_FILE = "state.safetensors"
FACTS_FILE = "provenance.json"
SIGNATURE_FILE = "provenance.sig"
MANIFEST_NAME = re.compile(r"v\d{8}\.[a-z]+(-\d{8})?(\.s\d+)?\.json")
"""A route entry: a plain file name under provenance/manifests/ (never a path that leaves it)."""


class ReleaseInvalid(ValueError):
    """The directory is not what the trainer's key signed; the message says where."""


class RunCounts(BaseModel):
    workers_registered: int
    workers_contributed: int
    """Workers with at least one rollout the trainer trained on."""
    workers_quarantined: int
    rollouts_accepted: int
    rollouts_trained: int
    rollouts_rejected: int
    """Submissions refused at ingestion (every reason)."""
    groups_expired: int


class StageFacts(BaseModel):
    """One stage of a release of a run trained by stage trainers (`release/stage_release.py`)."""

    stage: int
    layers: list[int]
    """Its decoder layers [start, end)."""
    public_key: str
    """Hex of its stage trainer's key: it signed this stage's manifests, and this provenance
    (`provenance.sig` for stage 0, `stage-S.sig` for the others)."""
    state_sha256: str
    """`codec.state_hash` of this stage's part of the published state."""
    route: list[str]
    """File names under provenance/manifests/ of the signed manifests that rebuild this stage."""


class Provenance(BaseModel):
    run_id: str
    version: int
    state_sha256: str
    """`codec.state_hash` of the published state of `version`, as signed by the trainer."""
    trainer_public_key: str
    """Hex of the trainer's Ed25519 public key (the run's registered key); it signs this file."""
    route: list[str]
    """File names under provenance/manifests/ of the signed manifests that rebuild `version`."""
    versions: dict[int, str]
    """State hash of every version the run published (the chain the signed manifests link)."""
    counts: RunCounts
    config: dict[str, Any]
    """The run's config as shown to others (`config.shareable`)."""
    evaluation: dict[str, Any] | None
    """The `decentrl eval` report of the directory (also `eval_results.json`); None: `--no-eval`."""
    files: dict[str, str]
    """SHA-256 of every file of the directory but the card and this file and its signature, by
    path relative to the directory: all that `transformers` may read is here (release/files.py)."""
    stages: list[StageFacts] | None = None
    """A run trained by stage trainers: each stage's key, hash and route (`trainer_public_key` is
    then stage 0's, and `state_sha256` the hash over the stage hashes)."""

    @field_validator("route")
    @classmethod
    def _plain_names(cls, route: list[str]) -> list[str]:
        for name in route:
            if not MANIFEST_NAME.fullmatch(name):
                raise ValueError(
                    f"route entry {name[:80]!r} is not a manifest file name (vNNNNNNNN.KIND.json)"
                )
        return route


def _count(db: Connection, query: str, *args: object) -> int:
    found = rows(db, query, *args)  # none: a table the run never created (no verifier, no reputation)
    return int(found[0][0] or 0) if found else 0


def run_counts(run_dir: Path) -> RunCounts:
    with read_only(run_dir) as db:
        trained = "SELECT {} FROM rollouts JOIN tasks USING (task_id) WHERE tasks.state = 'trained'"
        return RunCounts(
            workers_registered=_count(db, "SELECT COUNT(*) FROM workers"),
            workers_contributed=_count(db, trained.format("COUNT(DISTINCT rollouts.worker_id)")),
            workers_quarantined=_count(db, "SELECT COUNT(*) FROM reputation WHERE quarantined IS NOT NULL"),
            rollouts_accepted=_count(db, "SELECT COUNT(*) FROM rollouts"),
            rollouts_trained=_count(db, trained.format("COUNT(*)")),
            rollouts_rejected=_count(db, "SELECT COUNT(*) FROM events WHERE kind = 'rejected'"),
            groups_expired=_count(db, "SELECT COUNT(*) FROM events WHERE kind = 'group_expired'"),
        )


def run_id(run_dir: Path) -> str:
    with read_only(run_dir) as db:
        return db.execute("SELECT value FROM meta WHERE key = 'run_id'").fetchone()[0]


def manifest_file(manifest: Manifest) -> str:
    anchor = "" if manifest.anchor is None else f"-{manifest.anchor:08d}"
    return f"v{manifest.version:08d}.{manifest.kind}{anchor}.json"


def write_route(out: Path, run: RunWeights, manifests: list[Manifest]) -> list[str]:
    """Write the route's manifests as published under provenance/manifests/; their file names."""
    directory = out / DIRECTORY
    (directory / "manifests").mkdir(parents=True, exist_ok=True)
    for manifest in manifests:
        (directory / "manifests" / manifest_file(manifest)).write_bytes(
            run.manifest_bytes(manifest.version, manifest.kind, manifest.anchor)
        )
    return [manifest_file(m) for m in manifests]


def write_state(out: Path, state: dict) -> None:
    """The published state itself (inference dtype, adapters unmerged) under provenance/."""
    from safetensors.torch import save_file

    (out / DIRECTORY).mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, out / DIRECTORY / STATE_FILE)
