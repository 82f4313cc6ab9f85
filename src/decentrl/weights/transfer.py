"""Fetching content-addressed chunks from peers and the coordinator, verifying every byte.

Only chunks missing from the local store are fetched, so an interrupted download resumes from the
last verified chunk. Each step asks up to `max_peer_attempts` random peers which chunks they hold
(`GET /chunks`, BitTorrent's bitfield exchange) and fetches one missing chunk that one of them has;
only when none has any does it take one random missing chunk from the coordinator. So the
coordinator sends each chunk about once and the swarm relays the rest; random choice spreads
different chunks first (standing in for BitTorrent's rarest-first). A peer whose bytes do not hash
to the chunk's name is recorded (counted here, reported to the coordinator) and never asked again;
an unreachable peer is skipped. No torch.
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
        pending = {chunk.sha256: chunk for chunk in self.store.missing(chunks)}
        received, unreliable, have = 0, set(), {}
        while pending:
            # Have-lists only grow while a version spreads: ask for fresh ones only when the cached
            # ones offer nothing still missing.
            offers = self._offers(pending, unreliable, have) or self._offers(
                pending, unreliable, have, refresh=True
            )
            if offers:
                peer, digest = self._random.choice(offers)
                data = self._from_peer(peer, f"/chunks/{digest}")
                if data is None:  # listed the chunk, then did not deliver it: skip it this time
                    unreliable.add(peer.worker_id)
                    continue
                if not self._accept(peer.worker_id, pending[digest], data):
                    continue
            else:
                digest = self._random.choice(sorted(pending))
                data = self._from_coordinator(pending[digest])
            received += len(data)
            del pending[digest]
        return received

    def _offers(
        self,
        pending: dict[str, ChunkEntry],
        unreliable: set[str],
        have: dict[str, tuple[PeerInfo, set[str]]],
        refresh: bool = False,
    ) -> list[tuple[PeerInfo, str]]:
        """(peer, chunk) pairs: pending chunks that good peers said they hold. With `refresh`, first
        replace `have` by the have-lists of a few random good peers."""
        skip = self.bad_peers | unreliable
        if refresh:
            candidates = [peer for peer in self.peers if peer.worker_id not in skip]
            have.clear()
            for peer in self._random.sample(candidates, min(len(candidates), self.max_peer_attempts)):
                listing = self._from_peer(peer, "/chunks")
                have[peer.worker_id] = (
                    peer,
                    set(listing.decode(errors="replace").split()) if listing else set(),
                )
        return [
            (peer, digest)
            for worker_id, (peer, held) in have.items()
            if worker_id not in skip
            for digest in sorted(held & pending.keys())
        ]

    def _from_coordinator(self, chunk: ChunkEntry) -> bytes:
        try:
            data = self.client.chunk(chunk.sha256)
        except RequestRejected as exc:
            log.warning("coordinator refused chunk %s: %s", chunk.sha256[:12], exc)
            raise ChunkUnavailable(chunk.sha256) from None
        if self._accept(COORDINATOR, chunk, data):
            return data
        raise ChunkUnavailable(chunk.sha256)

    def _from_peer(self, peer: PeerInfo, path: str) -> bytes | None:
        try:
            response = self._http.get(f"{peer.url.rstrip('/')}{path}")
        except httpx.HTTPError as exc:  # unreachable or cut off: try another source
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
