"""Published versions of a run trained by stage trainers: K signed manifests per version, one per stage.

With `trainer.pipeline_stages = K` no trainer process holds the whole policy: stage trainer s
registers its own key (`PUT /v1/trainer/key` with `stage`), and publishes its stage's manifests
(`PUT /v1/weights/manifests/{version}/{kind}?stage=s`), each carrying that stage's tensors only,
its stage hash, and its key's signature. The coordinator checks each against its stage's key and
its stage's history (a delta's parent hash is the stage's hash at version - 1, a patch's anchor
hash the stage's at the anchor) and keeps it *pending* until every stage's manifest of that version
is in; only then does the version exist (its row, `/v1/weights/latest`, the index), so pipeline
version v means every stage at v. A pending manifest is durable: a coordinator restart keeps it
(an answered upload is on disk), and a version completes across one.

With `weights.store = "peers"` the coordinator never stores a chunk: it refuses chunk uploads and
serves none, and a manifest is accepted on its signature and layout alone. Its chunks are served
by their stage trainer and relayed by the stage's holders (`weights/peer_store.py`). No torch.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from decentrl.coordinator.context import Context
from decentrl.coordinator.db.store import get_meta, latest_version, set_meta
from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.coordinator.weights.versions import WeightStore, _describe, _info
from decentrl.dbapi import Connection
from decentrl.protocol import TrainerKey, WeightsEntry, WeightsInfo
from decentrl.weights.manifest import Manifest, ManifestKey
from decentrl.weights.planner import index_entry
from decentrl.weights.sections import StageKey, stage_manifest_name, version_hash
from decentrl.weights.signing import BadSignature, parse_public_key, verify

log = logging.getLogger(__name__)

STAGE_KEY_META = "trainer_public_key.stage.{}"
STAGE_HASHES_META = "stage_hashes.v{}"
"""Each stage's state hash of a published version (the version's row holds the hash over them)."""
FULL_KINDS = ("snapshot", "delta")
"""The kinds that make a stage's state of a version (a patch only adds a route to one)."""


class StageWeightStore(WeightStore):
    """`WeightStore` for K stage trainers: manifests by (version, kind, anchor, stage)."""

    def __init__(self, context: Context):
        assert context.stage_map is not None, "stage trainers need a staged run (checked in the config)"
        self.num_stages = context.stage_map.num_stages
        self.peers_only = context.run.weights.store == "peers"
        self.stage_manifests: dict[StageKey, Manifest] = {}
        super().__init__(context)

    # ------------------------------------------------------------------ state

    def _load(self) -> None:
        with self.context.store.transaction() as db:
            latest = latest_version(db)
        pending = 0 if latest is None else latest + 1
        for path in self.manifest_dir.iterdir():
            if path.name.startswith("."):  # an interrupted write
                path.unlink()
                continue
            manifest = Manifest.model_validate_json(path.read_bytes())
            if manifest.version > pending:  # cannot happen: kept as the protocol refuses it
                path.unlink()
                continue
            self.stage_manifests[self._key(manifest)] = manifest
        self._mirror(latest)

    def _mirror(self, latest: int | None) -> None:
        """`manifests` (what the base class and `/v1/health` read): one per complete (version,
        kind, anchor), stage 0's, so that retention and snapshot requests see the versions."""
        self.manifests = {
            key[:3]: manifest
            for key, manifest in self.stage_manifests.items()
            if key[3] == 0 and latest is not None and key[0] <= latest
        }

    def _latest_row(self) -> int | None:
        with self.context.store.transaction() as db:
            return latest_version(db)

    @staticmethod
    def _key(manifest: Manifest) -> StageKey:
        assert manifest.stage is not None
        return (manifest.version, manifest.kind, manifest.anchor, manifest.stage)

    # ------------------------------------------------------------------ keys

    def trainer_key(self) -> str | None:
        return None  # every stage has its own: `stage_keys`

    def stage_keys(self) -> list[str | None]:
        with self.context.store.transaction() as db:
            return [get_meta(db, STAGE_KEY_META.format(stage)) for stage in range(self.num_stages)]

    def register_key(self, body: TrainerKey) -> dict:
        if body.stage is None or body.stage >= self.num_stages:
            raise ApiError(
                422,
                f"this run is trained by {self.num_stages} stage trainers: register each stage's key "
                "with its stage (trainer.pipeline_stages)",
                Reason.SCHEMA,
            )
        name = STAGE_KEY_META.format(body.stage)
        others = [
            stage
            for stage, key in enumerate(self.stage_keys())
            if key == body.public_key and stage != body.stage
        ]
        if others:
            raise ApiError(
                409,
                f"this key already signs stage {others[0]}: every stage trainer signs with a key of its own",
                Reason.CONFLICT,
            )
        with self.context.store.transaction() as db:
            current = get_meta(db, name)
            if current is not None and current != body.public_key:
                raise ApiError(
                    409,
                    f"stage {body.stage}'s trainer key is already registered and differs; restore that "
                    "stage trainer's signing_key.pem or start a new run",
                    Reason.CONFLICT,
                )
            set_meta(db, name, body.public_key)
        return {"public_key": body.public_key, "stage": body.stage}

    # ------------------------------------------------------------------ uploads

    def put_chunk(self, digest: str, data: bytes) -> dict:
        if self.peers_only:
            raise ApiError(
                409,
                'this coordinator keeps no chunks (weights.store = "peers"): serve them from the stage '
                "trainer's chunk server",
                Reason.CONFLICT,
            )
        return super().put_chunk(digest, data)

    def chunk_path(self, digest: str) -> Path:
        if self.peers_only:
            raise ApiError(
                404,
                'this coordinator keeps no chunks (weights.store = "peers"); ask the peers',
                Reason.UNKNOWN_CHUNK,
            )
        return super().chunk_path(digest)

    def put_manifest(self, key: ManifestKey, body: bytes, stage: int | None = None) -> WeightsInfo:
        if stage is None:
            raise ApiError(422, "a stage trainer's manifest is put with ?stage=S", Reason.SCHEMA)
        manifest = self._checked(key, body)
        if manifest.stage != stage:
            raise ApiError(
                422, f"manifest is stage {manifest.stage}'s, URL says stage {stage}", Reason.SCHEMA
            )
        public_key = self.stage_keys()[stage]
        if public_key is None:
            raise ApiError(
                409, f"no key registered for stage {stage}; PUT /v1/trainer/key first", Reason.CONFLICT
            )
        try:
            verify(manifest, parse_public_key(public_key))
        except BadSignature as error:
            raise ApiError(422, f"stage {stage}: {error}", Reason.SIGNATURE) from None
        if not self.peers_only:
            self._check_chunks(manifest)
        with self._lock:
            return self._publish(manifest)

    def _stage_hash(self, version: int | None, stage: int) -> str | None:
        """The state hash stage `stage` reached at `version`: any retained (or pending) manifest
        of it says, and a pruned version's is in the store (`_complete`): a patch may name a
        pruned anchor, as the run's base stays one."""
        for (held, _, _, of), manifest in self.stage_manifests.items():
            if held == version and of == stage:
                return manifest.state_sha256
        if version is None:
            return None
        with self.context.store.transaction() as db:
            recorded = get_meta(db, STAGE_HASHES_META.format(version))
        return None if recorded is None else json.loads(recorded)[stage]

    def _publish(self, manifest: Manifest) -> WeightsInfo:
        version, kind, stage = manifest.version, manifest.kind, manifest.stage
        assert stage is not None
        key = self._key(manifest)
        latest = self._latest_row()
        existing = self.stage_manifests.get(key)
        if existing is not None:
            if existing != manifest:
                raise ApiError(
                    409,
                    f"{_describe(manifest.key)} of stage {stage} is already published differently",
                    Reason.CONFLICT,
                )
            return self._answer(manifest)
        expected = 0 if latest is None else latest + 1
        if version > expected or (version < expected and kind != "patch" and version not in self._versions()):
            raise ApiError(
                409,
                f"cannot publish v{version} of stage {stage}: the next version must be {expected}",
                Reason.CONFLICT,
            )
        held = self._stage_hash(version, stage)
        if held is not None and held != manifest.state_sha256:
            raise ApiError(
                409,
                f"v{version} of stage {stage} is already published with another state hash",
                Reason.CONFLICT,
            )
        if kind == "delta" and self._stage_hash(version - 1, stage) != manifest.parent_state_sha256:
            raise ApiError(
                409,
                f"delta v{version} of stage {stage} does not apply to its stored v{version - 1}",
                Reason.CONFLICT,
            )
        if kind == "patch":
            # After this stage's delta or snapshot of the version (listed once every stage's is in).
            if held is None:
                raise ApiError(
                    409,
                    f"publish v{version}'s delta or snapshot of stage {stage} before its patches",
                    Reason.CONFLICT,
                )
            if self._stage_hash(manifest.anchor, stage) != manifest.anchor_state_sha256:
                raise ApiError(
                    409,
                    f"patch v{version} of stage {stage} names an anchor v{manifest.anchor} state never published",
                    Reason.CONFLICT,
                )
        if version == 0 and kind != "snapshot":
            raise ApiError(409, "version 0 must be a snapshot", Reason.CONFLICT)
        self._write(manifest, stage_manifest_name(key))
        with self.context.store.transaction() as db:
            self.stage_manifests[key] = manifest
            if version == expected:
                self._complete(db, version)
            self._prune(db)
        return self._answer(manifest)

    def _versions(self) -> set[int]:
        return {key[0] for key in self.stage_manifests}

    def _complete(self, db: Connection, version: int) -> None:
        """Version `version` exists once every stage's snapshot or delta of it is in."""
        parts = []
        for stage in range(self.num_stages):
            found = [
                manifest
                for (held, kind, _, of), manifest in self.stage_manifests.items()
                if held == version and of == stage and kind in FULL_KINDS
            ]
            if not found:
                return
            parts.append(min(found, key=lambda manifest: manifest.payload_bytes))
        digest = version_hash(part.state_sha256 for part in parts)
        set_meta(db, STAGE_HASHES_META.format(version), json.dumps([part.state_sha256 for part in parts]))
        db.execute(
            "INSERT INTO weights (version, path, sha256, num_bytes, created) VALUES (?, ?, ?, ?, ?)",
            (
                version,
                stage_manifest_name(self._key(parts[0])),
                digest,
                sum(part.payload_bytes for part in parts),
                self.context.clock(),
            ),
        )
        log.info("v%d published: every one of %d stages is in", version, self.num_stages)

    def _answer(self, manifest: Manifest) -> WeightsInfo:
        """The version's row once complete; until then what this stage's manifest says."""
        with self.context.store.transaction() as db:
            row = db.execute("SELECT * FROM weights WHERE version = ?", (manifest.version,)).fetchone()
        if row is not None:
            return _info(row)
        return WeightsInfo(
            version=manifest.version,
            sha256=manifest.state_sha256,
            num_bytes=manifest.payload_bytes,
            created_unix=self.context.clock(),
        )

    # ------------------------------------------------------------------ retention

    def retained_from(self) -> int:
        return self._retained_from(self._latest_row())

    def _retained_from(self, latest: int | None) -> int:
        """As for one trainer, with a snapshot version one where every stage has a snapshot."""
        if latest is None:
            return 0
        versions = {key[0] for key in self.stage_manifests if key[0] <= latest}
        start = latest - self.keep_versions + 1
        snapshots = [
            version
            for version in versions
            if version <= start
            and all(
                (version, "snapshot", None, stage) in self.stage_manifests for stage in range(self.num_stages)
            )
        ]
        return min(start, max(snapshots)) if snapshots else min(versions)

    def _prune(self, db: Connection) -> None:
        """Within the publishing transaction (`db`): the store runs one transaction at a time."""
        latest = latest_version(db)
        oldest = self._retained_from(latest)
        dropped: set[str] = set()
        for key in [key for key in self.stage_manifests if key[0] < oldest]:
            dropped.update(chunk.sha256 for chunk in self.stage_manifests.pop(key).chunks)
            (self.manifest_dir / stage_manifest_name(key)).unlink(missing_ok=True)
            db.execute("UPDATE weights SET pruned = 1 WHERE version = ?", (key[0],))
        self._mirror(latest)
        if self.peers_only:
            return
        # Only the chunks of the manifests dropped here: the stages upload concurrently, so a chunk
        # no manifest names yet may be one whose manifest is on its way.
        wanted = {chunk.sha256 for manifest in self.stage_manifests.values() for chunk in manifest.chunks}
        for digest in dropped - wanted:
            self.chunks.remove(digest)

    def _newest_snapshot(self) -> int | None:
        return max((key[0] for key in self.manifests if key[1] == "snapshot"), default=None)

    # ------------------------------------------------------------------ reads

    def refresh(self) -> None:
        """One coordinator per run of stage trainers: nothing to pick up from replicas."""

    def index(self) -> list[WeightsEntry]:
        latest = self._latest_row()
        return [
            index_entry(manifest)
            for key, manifest in sorted(self.stage_manifests.items(), key=lambda item: _order(item[0]))
            if latest is not None and key[0] <= latest
        ]

    def stage_manifest(self, key: ManifestKey, stage: int | None) -> Manifest:
        if stage is None:
            raise ApiError(
                404,
                f"this run is trained by {self.num_stages} stage trainers: fetch each stage's manifest "
                "with ?stage=S",
                Reason.UNKNOWN,
            )
        latest = self._latest_row()
        manifest = self.stage_manifests.get((*key, stage))
        if manifest is not None and latest is not None and key[0] <= latest:
            return manifest
        return self.manifest(key)  # the base class's 404 / 410 with its reason


def _order(key: StageKey) -> tuple[int, int, str, int]:
    return (key[0], key[3], key[1], -1 if key[2] is None else key[2])


def open_weight_store(context: Context) -> WeightStore:
    """The run's weight store: one trainer's, or (`trainer.pipeline_stages > 1`) its stage trainers'."""
    if context.run.trainer.pipeline_stages > 1:
        return StageWeightStore(context)
    return WeightStore(context)
