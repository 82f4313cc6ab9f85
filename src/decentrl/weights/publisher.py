"""The trainer's side: publish each version as a signed delta (and periodically a snapshot).

The trainer's master weights stay in its own precision; what is published is their cast to the
inference dtype (`weights.dtype`). Version v is a delta against the published state of v-1, plus
a full snapshot when v is divisible by `snapshot_every` (and whenever no previous state is at
hand: version 0, or the first publish after a restart). Chunks go up first, the manifest last:
the coordinator accepts a manifest only when every chunk it names is stored.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from decentrl.client import CoordinatorClient
from decentrl.config import WeightsConfig
from decentrl.protocol import TrainerKey
from decentrl.weights.chunks import cut
from decentrl.weights.codec import encode_state, published_state, state_hash
from decentrl.weights.manifest import Kind, Manifest
from decentrl.weights.signing import load_or_create_key, public_key_hex, sign
from decentrl.weights.snapshot import state_for_publication

log = logging.getLogger(__name__)


@dataclass
class Published:
    version: int
    kind: Kind
    payload_bytes: int
    state_sha256: str
    encode_seconds: float
    encodings: dict[str, int] = field(default_factory=dict)
    """How many tensors took each encoding."""


def build_manifest(
    version: int,
    old: dict[str, torch.Tensor] | None,
    new: dict[str, torch.Tensor],
    dtype: str,
    chunk_bytes: int,
    new_sha256: str,
    old_sha256: str | None = None,
) -> tuple[Manifest, list]:
    """An unsigned manifest (a delta when `old` is given) and its chunks as (entry, bytes)."""
    entries, payload = encode_state(old, new)
    pieces = cut(payload, chunk_bytes)
    manifest = Manifest(
        version=version,
        kind="snapshot" if old is None else "delta",
        parent=None if old is None else version - 1,
        parent_state_sha256=old_sha256,
        dtype=dtype,
        tensors=entries,
        chunks=[entry for entry, _ in pieces],
        payload_bytes=len(payload),
        state_sha256=new_sha256,
    )
    return manifest, pieces


class Publisher:
    def __init__(self, client: CoordinatorClient, config: WeightsConfig, key_path: Path):
        self.client = client
        self.config = config
        self.key = load_or_create_key(key_path)
        self.public_key = public_key_hex(self.key)
        self.previous: tuple[int, dict[str, torch.Tensor], str] | None = None
        self.history: list[Published] = []

    def register(self) -> None:
        self.client.register_trainer_key(TrainerKey(public_key=self.public_key))
        log.info("trainer public key %s (pin it with worker.trainer_public_key)", self.public_key)

    def publish(self, model: torch.nn.Module, version: int) -> list[Published]:
        """Publish `version` from the model's current weights; idempotent for an already published one."""
        return self.publish_state(state_for_publication(model), version)

    def publish_state(self, state: dict[str, torch.Tensor], version: int) -> list[Published]:
        state = published_state(state, self.config.dtype)
        digest = state_hash(state)
        kinds: list[Kind] = []
        if self.previous is not None and self.previous[0] == version - 1:
            kinds.append("delta")
        if version % self.config.snapshot_every == 0 or not kinds:
            kinds.append("snapshot")
        done = [self._publish_one(version, kind, state, digest) for kind in kinds]
        self.previous = (version, state, digest)
        self.history.extend(done)
        return done

    def _publish_one(self, version: int, kind: Kind, state: dict, digest: str) -> Published:
        started = time.perf_counter()
        old, old_sha = (self.previous[1], self.previous[2]) if kind == "delta" else (None, None)
        manifest, pieces = build_manifest(
            version, old, state, self.config.dtype, self.config.chunk_bytes, digest, old_sha
        )
        encoded = time.perf_counter() - started
        for entry, data in pieces:
            self.client.upload_chunk(entry.sha256, data)
        signed = sign(manifest, self.key)
        self.client.upload_manifest(version, kind, signed.model_dump_json().encode())
        counts: dict[str, int] = {}
        for tensor in manifest.tensors:
            counts[tensor.encoding] = counts.get(tensor.encoding, 0) + 1
        return Published(version, kind, manifest.payload_bytes, digest, encoded, counts)
