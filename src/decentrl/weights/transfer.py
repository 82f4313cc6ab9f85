"""Fetching content-addressed chunks from peers and the coordinator, verifying every byte.

For each chunk still missing from the local store (so an interrupted download resumes from the
last verified chunk), the fetcher asks up to `max_peer_attempts` random peers, then the
coordinator. A peer that does not hold the chunk answers 404 and costs one round trip; a peer
whose bytes do not hash to the chunk's name is recorded (counted here, reported to the
coordinator) and never asked again. Chunks are fetched in a random order so that a swarm of
workers spreads different chunks first and can serve each other (BitTorrent's rarest-first, with
randomness standing in for rarity). No torch.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Iterable

import httpx

from decentrl.client import CoordinatorClient, RequestRejected
from decentrl.protocol import PeerInfo, PeerReport
from decentrl.weights.chunks import ChunkStore
from decentrl.weights.manifest import ChunkEntry

log = logging.getLogger(__name__)

COORDINATOR = "coordinator"


class ChunkUnavailable(LookupError):
    """No source served a chunk whose bytes hash to its name."""

    def __init__(self, digest: str):
        super().__init__(f"no source served a valid copy of chunk {digest}")
        self.digest = digest


class ChunkFetcher:
    def __init__(
        self,
        client: CoordinatorClient,
        store: ChunkStore,
        *,
        max_peer_attempts: int = 3,
        peer_timeout: float = 30.0,
        seed: int | None = None,
    ):
        self.client = client
        self.store = store
        self.max_peer_attempts = max_peer_attempts
        self.peers: list[PeerInfo] = []
        self.bad_peers: set[str] = set()
        self.bytes_from: Counter[str] = Counter()
        """Verified bytes received per source (a peer's worker id, or 'coordinator')."""
        self.rejected_from: Counter[str] = Counter()
        """Chunks per source whose bytes did not match their hash."""
        self._random = random.Random(seed)
        self._http = httpx.Client(timeout=peer_timeout)

    def close(self) -> None:
        self._http.close()

    def fetch(self, chunks: Iterable[ChunkEntry]) -> int:
        """Make every chunk present in the store; returns the bytes downloaded."""
        missing = {chunk.sha256: chunk for chunk in self.store.missing(chunks)}
        order = list(missing.values())
        self._random.shuffle(order)
        received = 0
        for chunk in order:
            if not self.store.has(chunk.sha256):  # shared by two manifests of the route
                received += self._fetch_one(chunk)
        return received

    def _fetch_one(self, chunk: ChunkEntry) -> int:
        candidates = [peer for peer in self.peers if peer.worker_id not in self.bad_peers]
        self._random.shuffle(candidates)
        for peer in candidates[: self.max_peer_attempts]:
            data = self._from_peer(peer, chunk.sha256)
            if data is not None and self._accept(peer.worker_id, chunk, data):
                return len(data)
        try:
            data = self.client.chunk(chunk.sha256)
        except RequestRejected as exc:
            log.warning("coordinator refused chunk %s: %s", chunk.sha256[:12], exc)
            raise ChunkUnavailable(chunk.sha256) from None
        if self._accept(COORDINATOR, chunk, data):
            return len(data)
        raise ChunkUnavailable(chunk.sha256)

    def _from_peer(self, peer: PeerInfo, digest: str) -> bytes | None:
        try:
            response = self._http.get(f"{peer.url.rstrip('/')}/chunks/{digest}")
        except httpx.HTTPError as exc:  # unreachable or cut off: try the next source
            log.debug("peer %s: %s", peer.worker_id, exc)
            return None
        return response.content if response.status_code == 200 else None

    def _accept(self, source: str, chunk: ChunkEntry, data: bytes) -> bool:
        if len(data) == chunk.size and self.store.put(chunk.sha256, data):
            self.bytes_from[source] += len(data)
            return True
        self.rejected_from[source] += 1
        log.warning("%s served a bad copy of chunk %s (%d bytes)", source, chunk.sha256[:12], len(data))
        if source != COORDINATOR:
            self.bad_peers.add(source)
            try:
                self.client.report_peer(
                    PeerReport(worker_id=source, sha256=chunk.sha256, reason="hash mismatch")
                )
            except RequestRejected as exc:
                log.warning("could not report peer %s: %s", source, exc)
        return False
