"""Fetching content-addressed chunks from peers and the coordinator, verifying every byte.

Only chunks missing from the local store are fetched, so an interrupted download resumes from the
last verified chunk. Each step asks up to `max_peer_attempts` peers which chunks they hold
(`GET /chunks`, BitTorrent's bitfield exchange) and fetches one missing chunk that one of them has;
only when none has any does it take one random missing chunk from the coordinator. So the
coordinator sends each chunk about once and the swarm relays the rest; random choice spreads
different chunks first (standing in for BitTorrent's rarest-first).

Peers are asked in two ranks: first the *preferred* ones (established on the coordinator's list, or
that delivered verified chunks to this fetcher), then, for chunks none of those holds, the rest.
Within a rank the choice is random, weighted by the chunks a peer delivered and against its failures.
So identities made by the dozen are asked only for what proven peers lack.

Every answer is bounded: an overall deadline (`peer_deadline` plus the time the chunk takes at
`min_peer_bytes_per_second`), and a size cap from the manifest (the chunk's length), enforced while
the bytes stream in, so that a peer trickling a byte at a time or sending gigabytes costs one
deadline or one chunk's memory. A peer whose bytes overflow the chunk or do not hash to its name is
recorded (counted here, reported to the coordinator) and never asked again; a slow or unreachable
one is skipped for this fetch and, after `MAX_FAILURES`, for good (a seeder, a stage trainer of a
run whose coordinator keeps no chunks, only for this fetch). No torch.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Iterable, Sequence

import httpx

from decentrl.client import CoordinatorClient, RequestRejected
from decentrl.protocol import PeerInfo, PeerReport
from decentrl.weights.chunks import ChunkStore
from decentrl.weights.manifest import ChunkEntry

log = logging.getLogger(__name__)

COORDINATOR = "coordinator"
MAX_LISTING_BYTES = 1 << 20
"""Largest have-list read from a peer (65 bytes a chunk name: 16,000 chunks)."""
MAX_FAILURES = 2
"""Slow or broken answers after which a peer is not asked again by this fetcher."""


class ChunkUnavailable(LookupError):
    """No source served a chunk whose bytes hash to its name."""

    def __init__(self, digest: str):
        super().__init__(f"no source served a valid copy of chunk {digest}")
        self.digest = digest


class Overflow(Exception):
    """A peer's answer is larger than the chunk it stands for."""


class ChunkFetcher:
    def __init__(
        self,
        client: CoordinatorClient,
        store: ChunkStore,
        *,
        max_peer_attempts: int = 3,
        peer_timeout: float = 10.0,
        peer_deadline: float = 10.0,
        min_peer_bytes_per_second: float = 256e3,
        seed: int | None = None,
    ):
        """`peer_timeout`: connect and per-read limit; `peer_deadline` plus the chunk's size at
        `min_peer_bytes_per_second`: the limit on one whole answer from a peer."""
        self.client = client
        self.store = store
        self.max_peer_attempts = max_peer_attempts
        self.peer_deadline = peer_deadline
        self.min_peer_bytes_per_second = min_peer_bytes_per_second
        self.peers: list[PeerInfo] = []
        self.bad_peers: set[str] = set()
        self.bytes_from: Counter[str] = Counter()
        """Verified bytes received per source (a peer's worker id, or 'coordinator')."""
        self.chunks_from: Counter[str] = Counter()
        """Verified chunks received per source."""
        self.rejected_from: Counter[str] = Counter()
        """Chunks per source whose bytes did not match their hash (or overflowed it)."""
        self.failed_from: Counter[str] = Counter()
        """Answers per peer that came too slowly, broke off, or were refused after an offer."""
        self._random = random.Random(seed)
        self._http = httpx.Client(timeout=peer_timeout)

    def close(self) -> None:
        self._http.close()

    def fetch(self, chunks: Iterable[ChunkEntry]) -> int:
        """Make every chunk present in the store; returns the bytes downloaded."""
        pending = {chunk.sha256: chunk for chunk in self.store.missing(chunks)}
        received, skip, have = 0, set(), {}
        while pending:
            # Have-lists only grow while a version spreads: ask for fresh ones only when the cached
            # ones offer nothing still missing, preferred peers before the rest.
            offers = self._offers(pending, skip, have)
            for rank in (True, False):
                if offers:
                    break
                offers = self._offers(pending, skip, have, refresh=self._ranked(skip, rank))
            if offers:
                peer, digest = self._choose(offers)
                data = self._from_peer(peer, f"/chunks/{digest}", pending[digest].size)
                if data is None:  # listed the chunk, then did not deliver it: skip it this time
                    skip.add(peer.worker_id)
                    continue
                if not self._accept(peer.worker_id, pending[digest], data):
                    continue
            else:
                digest = self._random.choice(sorted(pending))
                data = self._from_coordinator(pending[digest])
            received += len(data)
            del pending[digest]
        return received

    def _usable(self, worker_id: str, skip: set[str]) -> bool:
        # A seeder (a stage trainer, weights.store = "peers") may be the only source of a new
        # version: slowness skips it for this fetch, never for good.
        seeder = any(peer.worker_id == worker_id and peer.seeder for peer in self.peers)
        return (
            worker_id not in skip
            and worker_id not in self.bad_peers
            and (self.failed_from[worker_id] < MAX_FAILURES or seeder)
        )

    def _weight(self, worker_id: str) -> float:
        return (1 + self.chunks_from[worker_id]) / (1 + self.failed_from[worker_id]) ** 2

    def _ranked(self, skip: set[str], preferred: bool) -> list[PeerInfo]:
        """Up to `max_peer_attempts` usable peers of one rank, weighted at random (the keys of
        Efraimidis and Spirakis 2006: u ** (1 / weight), largest first); in the preferred rank the
        usable seeders come first and always: a new version's chunks may be nowhere else, however
        often a seeder was slow before."""
        rank = [
            peer
            for peer in self.peers
            if self._usable(peer.worker_id, skip)
            and (peer.established or self.chunks_from[peer.worker_id] > 0) == preferred
        ]
        seeders = [peer for peer in rank if peer.seeder]
        others = [peer for peer in rank if not peer.seeder]
        others.sort(key=lambda peer: -(self._random.random() ** (1 / self._weight(peer.worker_id))))
        return [*seeders, *others[: self.max_peer_attempts]]

    def _choose(self, offers: Sequence[tuple[PeerInfo, str]]) -> tuple[PeerInfo, str]:
        weights = [self._weight(peer.worker_id) for peer, _ in offers]
        return self._random.choices(offers, weights)[0]

    def _offers(
        self,
        pending: dict[str, ChunkEntry],
        skip: set[str],
        have: dict[str, tuple[PeerInfo, set[str]]],
        refresh: list[PeerInfo] | None = None,
    ) -> list[tuple[PeerInfo, str]]:
        """(peer, chunk) pairs: pending chunks that usable peers said they hold. With `refresh`,
        first replace `have` by the have-lists of those peers."""
        if refresh is not None:
            have.clear()
            for peer in refresh:
                listing = self._from_peer(peer, "/chunks", MAX_LISTING_BYTES)
                if listing is None:
                    skip.add(peer.worker_id)
                held = set(listing.decode(errors="replace").split()) if listing else set()
                have[peer.worker_id] = (peer, held)
        return [
            (peer, digest)
            for worker_id, (peer, held) in have.items()
            if self._usable(worker_id, skip)
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

    def _from_peer(self, peer: PeerInfo, path: str, limit: int) -> bytes | None:
        """The peer's answer, or None (refused, unreachable, too slow: a failure). An answer larger
        than `limit` is misbehaviour: the peer is reported and never asked again."""
        try:
            return self._read(peer, path, limit)
        except Overflow:
            self._misbehaved(peer.worker_id, path.removeprefix("/chunks").lstrip("/"), f"over {limit} bytes")
        except (httpx.HTTPError, TimeoutError, ValueError) as exc:  # unreachable, cut off, too slow, garbled
            log.log(logging.INFO if peer.seeder else logging.DEBUG, "peer %s: %s", peer.worker_id, exc)
        self.failed_from[peer.worker_id] += 1
        return None

    def _read(self, peer: PeerInfo, path: str, limit: int) -> bytes | None:
        deadline = time.monotonic() + self.peer_deadline + limit / self.min_peer_bytes_per_second
        # The worker builds the path: an announcement names only the scheme, address and port.
        with self._http.stream("GET", f"{peer.url}{path}") as response:
            if response.status_code != 200:
                if peer.seeder:
                    log.info("seeder %s answered %s %d", peer.worker_id, path[:24], response.status_code)
                return None
            if int(response.headers.get("Content-Length") or 0) > limit:
                raise Overflow
            data = bytearray()
            for piece in response.iter_bytes():
                data += piece
                if len(data) > limit:  # abort while streaming: never buffer more than the chunk
                    raise Overflow
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{path} took longer than {deadline:.1f}s allows")
            return bytes(data)

    def _accept(self, source: str, chunk: ChunkEntry, data: bytes) -> bool:
        if len(data) == chunk.size and self.store.put(chunk.sha256, data):
            self.bytes_from[source] += len(data)
            self.chunks_from[source] += 1
            return True
        self.rejected_from[source] += 1
        log.warning("%s served a bad copy of chunk %s (%d bytes)", source, chunk.sha256[:12], len(data))
        if source != COORDINATOR:
            self._misbehaved(source, chunk.sha256, "hash mismatch")
        return False

    def _misbehaved(self, peer: str, digest: str, reason: str) -> None:
        """Never ask `peer` again, and tell the coordinator (for a chunk, not a have-list)."""
        self.bad_peers.add(peer)
        if len(digest) != 64:
            return
        try:
            self.client.report_peer(PeerReport(worker_id=peer, sha256=digest, reason=reason))
        except RequestRejected as exc:
            log.warning("could not report peer %s: %s", peer, exc)
