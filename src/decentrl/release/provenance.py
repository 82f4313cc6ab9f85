"""Where an exported model comes from, as facts a reader can check.

`provenance/provenance.json` in an export holds: the run, the exported version and its state hash,
the trainer's public key, the signed manifests of the route that rebuilds the version (a snapshot,
then deltas or a patch; `provenance/manifests/`), the state hash of every version the run
published, and what the coordinator counted (workers, rollouts accepted, trained, rejected,
quarantines). `provenance/state.safetensors` is the published state itself (inference dtype,
LoRA adapters unmerged): its hash is the one the trainer signed, and merging it gives the model's
weights (`decentrl verify-release` checks both).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from decentrl.dbapi import Connection
from decentrl.weights.manifest import Manifest
from decentrl.weights.run_dir import RunWeights, read_only, rows

DIRECTORY = "provenance"
STATE_FILE = "state.safetensors"
FACTS_FILE = "provenance.json"


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


class Provenance(BaseModel):
    run_id: str
    version: int
    state_sha256: str
    """`codec.state_hash` of the published state of `version`, as signed by the trainer."""
    trainer_public_key: str
    """Hex of the trainer's Ed25519 public key (the run's registered key)."""
    route: list[str]
    """File names under provenance/manifests/ of the signed manifests that rebuild `version`."""
    versions: dict[int, str]
    """State hash of every version the run published (the chain the signed manifests link)."""
    counts: RunCounts


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


def write_provenance(
    out: Path, run: RunWeights, version: int, state: dict, manifests: list[Manifest]
) -> Provenance:
    """Write provenance/ (facts, the route's manifests as published, the published state)."""
    from safetensors.torch import save_file

    directory = out / DIRECTORY
    (directory / "manifests").mkdir(parents=True, exist_ok=True)
    for manifest in manifests:
        (directory / "manifests" / manifest_file(manifest)).write_bytes(
            run.manifest_bytes(manifest.version, manifest.kind, manifest.anchor)
        )
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, directory / STATE_FILE)
    facts = Provenance(
        run_id=run_id(run.run_dir),
        version=version,
        state_sha256=run.versions[version],
        trainer_public_key=run.trainer_public_key,
        route=[manifest_file(m) for m in manifests],
        versions=run.versions,
        counts=run_counts(run.run_dir),
    )
    (directory / FACTS_FILE).write_text(facts.model_dump_json(indent=2))
    return facts
