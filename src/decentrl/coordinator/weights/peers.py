"""Peer lists for weight chunks: which workers serve chunks, and which misbehaved.

Workers that accept connections announce their chunk server's URL and the version they hold;
the coordinator hands the list to other workers. The list lives in memory (workers re-announce
after every version and on a timer, so a restarted coordinator relearns it within seconds).
A peer reported for serving bytes that do not match a chunk's hash gets an event row, and after
`MAX_REPORTS` distinct reports it is never listed again (the counts are rebuilt from the events
table at start, so a restart does not forgive it).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from decentrl.coordinator.context import Context
from decentrl.coordinator.db.store import add_event
from decentrl.protocol import PeerAnnounce, PeerInfo, PeerReport

PEER_MISBEHAVED = "peer_misbehaved"
MAX_REPORTS = 3
"""Reports (from distinct reporters) that take a peer off the lists."""
PEER_TTL_SECONDS = 120.0
MAX_LISTED = 32


@dataclass
class Peer:
    url: str
    version: int
    seen: float


class PeerTable:
    def __init__(self, context: Context):
        self.context = context
        self._peers: dict[str, Peer] = {}
        self._reports: dict[str, set[str]] = {}
        self._lock = threading.Lock()
        with context.store.transaction() as db:
            rows = db.execute(
                "SELECT worker_id, reason FROM events WHERE kind = ?", (PEER_MISBEHAVED,)
            ).fetchall()
        for row in rows:
            reporter = row["reason"].split(" ", 1)[0]
            self._reports.setdefault(row["worker_id"], set()).add(reporter)

    def announce(self, worker_id: str, body: PeerAnnounce) -> None:
        with self._lock:
            self._peers[worker_id] = Peer(body.url, body.version, self.context.clock())

    def banned(self, worker_id: str) -> bool:
        return len(self._reports.get(worker_id, ())) >= MAX_REPORTS

    def listing(self, asker: str) -> list[PeerInfo]:
        now = self.context.clock()
        with self._lock:
            live = [
                PeerInfo(worker_id=worker_id, url=peer.url, version=peer.version)
                for worker_id, peer in self._peers.items()
                if worker_id != asker and now - peer.seen < PEER_TTL_SECONDS and not self.banned(worker_id)
            ]
        return sorted(live, key=lambda peer: -peer.version)[:MAX_LISTED]

    def report(self, reporter: str, body: PeerReport) -> None:
        """Record one report durably (an event row) and count it against the peer."""
        with self.context.store.transaction() as db:
            reason = f"{reporter} chunk {body.sha256[:16]}: {body.reason}"
            add_event(db, self.context.clock(), PEER_MISBEHAVED, body.worker_id, reason)
        with self._lock:
            self._reports.setdefault(body.worker_id, set()).add(reporter)
            if self.banned(body.worker_id):
                self._peers.pop(body.worker_id, None)

    def reports(self, worker_id: str) -> int:
        return len(self._reports.get(worker_id, ()))
