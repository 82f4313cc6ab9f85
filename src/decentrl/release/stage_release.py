"""Releasing a run that stage trainers trained: every stage trainer's consent, every stage's chain.

No process of such a run holds the whole model, so a release is the one place it is put together,
and it happens only with every stage trainer's part:

- each stage is rebuilt from that stage's signed manifests alone, by a holder's own path
  (`weights/sync.py` with `stage_signed`), its chunks read from the coordinator's store or, with
  `weights.store = "peers"`, from the stage trainer's own store (`trainer/stage-S/chunks`);
- each stage trainer's key (`trainer/stage-S/signing_key.pem`, which never left that trainer) must
  be the one registered for its stage, and signs the release's provenance: stage 0's signature is
  `provenance/provenance.sig`, stage S's `provenance/stage-S.sig`. Without every stage trainer's key
  there is no release;
- the provenance records, per stage, its layers, its key, its state hash and the route of signed
  manifests that rebuilt it (`StageFacts`), and the model card says which key signed which stage.

`decentrl verify-release` then checks every stage's signature on the provenance, every stage's
manifests under its own key and their chain, that each stage's part of the published state hashes
to its signed stage hash, and that those hashes make the version's hash the run recorded.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from decentrl.config import ConfigError
from decentrl.release.provenance import DIRECTORY, ReleaseInvalid, StageFacts
from decentrl.release.signature import check_signature, load_signing_key
from decentrl.stage_map import StageMap
from decentrl.weights.manifest import Manifest
from decentrl.weights.planner import index_entry
from decentrl.weights.run_dir import NotARun, read_only, store_location
from decentrl.weights.sections import stage_manifest_name, version_hash

STAGE_SIGNATURE = "stage-{}.sig"
"""Stage S's signature of the provenance, S >= 1 (`release/files.py` leaves these unsigned)."""


def stage_keys_of(run_dir: Path) -> list[str] | None:
    """The stage trainers' keys of the run in `run_dir` by stage; None: a run of one trainer."""
    if store_location(run_dir) is None:
        return None
    with read_only(run_dir) as db:
        found = db.execute(
            "SELECT key, value FROM meta WHERE key LIKE 'trainer_public_key.stage.%'"
        ).fetchall()
    if not found:
        return None
    keys = {int(row[0].rsplit(".", 1)[1]): row[1] for row in found}
    return [keys[stage] for stage in sorted(keys)]


class StageRun:
    """A stage-trained run directory read offline: its versions, each stage's signed manifests, and
    for each stage the subset of `CoordinatorClient` that `WeightSync` uses (`client`)."""

    def __init__(self, run_dir: Path, trainer_dir: Path):
        self.run_dir, self.trainer_dir = Path(run_dir), Path(trainer_dir)
        keys = stage_keys_of(self.run_dir)
        if keys is None:
            raise NotARun(f"{run_dir} is not a run of stage trainers")
        self.stage_keys = keys
        with read_only(self.run_dir) as db:
            self.versions: dict[int, str] = {
                row["version"]: row["sha256"] for row in db.execute("SELECT version, sha256 FROM weights")
            }
        if not self.versions:
            raise NotARun(f"{run_dir}: the stage trainers never published a version")
        self.raw: dict[tuple, bytes] = {}
        self.manifests: dict[tuple, Manifest] = {}
        for path in sorted((self.run_dir / "weights" / "manifests").glob("v*.s*.json")):
            raw = path.read_bytes()
            manifest = Manifest.model_validate_json(raw)
            if manifest.version in self.versions:  # a pending one is not published
                key = (manifest.version, manifest.kind, manifest.anchor, manifest.stage)
                self.manifests[key], self.raw[key] = manifest, raw
        stage_map = next(iter(self.manifests.values())).stage_map
        assert stage_map is not None, "a stage trainer's manifest names the map"
        self.stage_map: StageMap = stage_map

    @property
    def latest_version(self) -> int:
        return max(self.versions)

    def client(self, stage: int) -> _StageClient:
        return _StageClient(self, stage)


class _StageClient:
    def __init__(self, run: StageRun, stage: int):
        self.run, self.stage = run, stage

    def weights_index(self) -> list:
        return [index_entry(m) for key, m in self.run.manifests.items() if key[3] == self.stage]

    def manifest_bytes(
        self, version: int, kind: str, anchor: int | None = None, stage: int | None = None
    ) -> bytes:
        return self.run.raw[(version, kind, anchor, stage)]

    def chunk(self, sha256: str) -> bytes:
        for root in (
            self.run.run_dir / "weights" / "chunks",
            self.run.trainer_dir / f"stage-{self.stage}" / "chunks",
        ):
            path = root / sha256[:2] / sha256
            if path.is_file():
                return path.read_bytes()
        raise FileNotFoundError(
            f"chunk {sha256} is neither in the run's store nor stage {self.stage}'s trainer's"
        )

    def request_snapshot(self) -> dict:
        return {"pending": False}


def rebuild(run: StageRun, version: int) -> tuple[dict, list[StageFacts], list[list[Manifest]]]:
    """The published state of `version`, every stage rebuilt from its own signed manifests, with
    each stage's facts and route. Raises ConfigError when a stage cannot be rebuilt."""
    import torch

    from decentrl.weights.chunks import ChunkStore
    from decentrl.weights.signing import parse_public_key
    from decentrl.weights.sync import VerificationFailed, WeightSync
    from decentrl.weights.transfer import ChunkFetcher

    if version not in run.versions:
        raise ConfigError(f"{run.run_dir}: no version {version}; it published v0..v{run.latest_version}")
    whole: dict[str, torch.Tensor] = {}
    facts, routes = [], []
    for stage, key in enumerate(run.stage_keys):
        client = run.client(stage)
        with tempfile.TemporaryDirectory(prefix="decentrl-export-") as cache:
            fetcher = ChunkFetcher(client, ChunkStore(Path(cache), durable=False))  # type: ignore[arg-type]
            try:
                sync = WeightSync(
                    client,  # type: ignore[arg-type]
                    parse_public_key(key),
                    fetcher,
                    None,
                    stage,
                    run.stage_map,
                    stage_signed=True,
                )
                sync.sync_to(version)
            except (VerificationFailed, FileNotFoundError, LookupError) as exc:
                raise ConfigError(
                    f"stage {stage} of v{version} cannot be rebuilt ({exc}); export needs every stage "
                    "trainer's chunks (with weights.store = peers: --trainer-dir holding each trainer's stage-S/)"
                ) from None
            finally:
                fetcher.close()
        route = sync.routes[-1][2]
        manifests = [run.manifests[(v, kind, route.anchor(v, kind), stage)] for v, kind in route.steps]
        for name, tensor in sync.state.items():
            if name in whole and not torch.equal(whole[name], tensor):
                raise ConfigError(f"v{version}: stages {stage} and an earlier one disagree on {name}")
            whole[name] = tensor
        layers = run.stage_map.layers(stage)
        facts.append(
            StageFacts(
                stage=stage,
                layers=[layers.start, layers.stop],
                public_key=key,
                state_sha256=manifests[-1].state_sha256,
                route=[stage_manifest_name((m.version, m.kind, m.anchor, stage)) for m in manifests],
            )
        )
        routes.append(manifests)
    if version_hash(f.state_sha256 for f in facts) != run.versions[version]:
        raise ConfigError(f"v{version}: the stages' hashes do not make the version's recorded hash")
    return whole, facts, routes


def stage_signing_keys(run: StageRun) -> list:
    """Every stage trainer's key, each checked against the one registered for its stage: without
    all of them there is no release (each stage trainer consents by signing)."""
    return [
        load_signing_key(run.trainer_dir / f"stage-{stage}" / "signing_key.pem", key)
        for stage, key in enumerate(run.stage_keys)
    ]


def write_stage_routes(out: Path, run: StageRun, routes: list[list[Manifest]]) -> list[str]:
    """Every stage's route manifests as published, under provenance/manifests/; their names."""
    directory = out / DIRECTORY / "manifests"
    directory.mkdir(parents=True, exist_ok=True)
    names = []
    for stage, manifests in enumerate(routes):
        for manifest in manifests:
            key = (manifest.version, manifest.kind, manifest.anchor, stage)
            names.append(stage_manifest_name(key))
            (directory / names[-1]).write_bytes(run.raw[key])
    return names


def sign_stages(out: Path, body: bytes, keys: list) -> None:
    """Stage S >= 1's signature of the provenance (stage 0's is provenance.sig)."""
    from decentrl.release.signature import sign

    for stage, key in enumerate(keys[1:], start=1):
        (out / DIRECTORY / STAGE_SIGNATURE.format(stage)).write_text(sign(body, key) + "\n")


def check_stage_signatures(directory: Path, body: bytes, stages: list[StageFacts]) -> None:
    for facts in stages[1:]:
        path = directory / DIRECTORY / STAGE_SIGNATURE.format(facts.stage)
        if not path.is_file():
            raise ReleaseInvalid(
                f"stage {facts.stage}'s trainer did not sign the release ({path.name} is missing)"
            )
        check_signature(body, path.read_text(), facts.public_key)


def check_stage_routes(
    directory: Path, version: int, recorded: str | None, stages: list[StageFacts], state: dict
) -> None:
    """Each stage's manifests verify under its own key and chain to its signed stage hash; its part
    of `state` hashes to that; the stage hashes make the run's recorded hash of `version`."""
    from decentrl.weights.codec import state_hash
    from decentrl.weights.signing import BadSignature, parse_public_key, verify
    from decentrl.weights.sync import VerificationFailed, check_chain

    stage_map = None
    for facts in stages:
        manifests = [
            Manifest.model_validate_json((directory / DIRECTORY / "manifests" / name).read_bytes())
            for name in facts.route
        ]
        for name, manifest in zip(facts.route, manifests, strict=True):
            try:
                verify(manifest, parse_public_key(facts.public_key))
            except BadSignature as exc:
                raise ReleaseInvalid(f"{name}: {exc} (stage {facts.stage}'s)") from None
            if manifest.stage != facts.stage:
                raise ReleaseInvalid(f"{name} is not a manifest of stage {facts.stage}")
        try:
            check_chain(manifests, None, None, facts.stage)
        except VerificationFailed as exc:
            raise ReleaseInvalid(f"stage {facts.stage}'s signed manifests do not chain: {exc}") from None
        if not manifests or (manifests[-1].version, manifests[-1].state_sha256) != (
            version,
            facts.state_sha256,
        ):
            raise ReleaseInvalid(
                f"stage {facts.stage}'s signed route does not end at v{version} with its state hash"
            )
        stage_map = manifests[-1].stage_map
        assert stage_map is not None
        part = {name: state[name] for name in stage_map.names(facts.stage, list(state))}
        if state_hash(part) != facts.state_sha256:
            raise ReleaseInvalid(
                f"stage {facts.stage}'s part of the published state is not what its key signed"
            )
    if version_hash(f.state_sha256 for f in stages) != recorded:
        raise ReleaseInvalid(f"the stages' signed hashes do not make the run's recorded state of v{version}")


def prepare(
    run_dir: Path, out: Path, version: int | None, trainer_dir: Path | None
) -> tuple[StageRun, list, int, dict, list[StageFacts], list[list[Manifest]]]:
    """Everything a release of a run of stage trainers needs before it is written (see the module
    docstring): (run, every stage trainer's signing key, version, published state, stage facts,
    routes). The keys first: without every stage's consent there is nothing to rebuild."""
    run = StageRun(run_dir, trainer_dir or run_dir / "trainer")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} is not empty; choose a new directory or remove it")
    keys = stage_signing_keys(run)
    version = run.latest_version if version is None else version
    state, stages, routes = rebuild(run, version)
    return run, keys, version, state, stages, routes
