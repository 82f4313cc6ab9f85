"""Peer lists for weight chunks: which workers serve chunks, and which misbehaved.

Workers that accept connections announce their chunk server's URL and the version they hold;
the coordinator hands the list to other workers. The list lives in memory (workers re-announce
after every version and on a timer, so a restarted coordinator relearns it within seconds).
A peer reported for serving bytes that do not match a chunk's hash gets an event row and is never
listed to its reporter again; after `MAX_REPORTS` reports from distinct *established* workers (past
their probation: `trust.probation_tokens` verified tokens, which sybils made for the purpose do not
have) it is listed to nobody (the counts are rebuilt from the events table at start, so a restart
does not forgive it). Workers check every chunk's hash anyway: a listing is an offer, never trust.

An announced URL must name an IP address (no name to re-resolve elsewhere later) that other workers
may be sent to: never link-local, multicast, unspecified or reserved, and a loopback or private
address only from a worker that itself connects from one (a local or LAN deployment).
"""

from __future__ import annotations

import ipaddress
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

from decentrl.coordinator.context import Context
from decentrl.coordinator.db.store import add_event
from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.coordinator.trust.reputation import tokens_verified
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
        self._established_reports: dict[str, set[str]] = {}
        self._lock = threading.Lock()
        with context.store.transaction() as db:
            rows = db.execute(
                "SELECT worker_id, reason FROM events WHERE kind = ?", (PEER_MISBEHAVED,)
            ).fetchall()
            for row in rows:
                self._count(db, row["reason"].split(" ", 1)[0], row["worker_id"])

    def _count(self, db, reporter: str, peer: str) -> None:  # noqa: ANN001 - a store connection
        self._reports.setdefault(peer, set()).add(reporter)
        if tokens_verified(db, reporter) >= self.context.run.trust.probation_tokens:
            self._established_reports.setdefault(peer, set()).add(reporter)

    def announce(self, worker_id: str, body: PeerAnnounce, address: str = "") -> None:
        check_peer_url(body.url, address)
        with self._lock:
            self._peers[worker_id] = Peer(body.url, body.version, self.context.clock())

    def banned(self, worker_id: str) -> bool:
        return len(self._established_reports.get(worker_id, ())) >= MAX_REPORTS

    def listing(self, asker: str) -> list[PeerInfo]:
        now = self.context.clock()
        with self._lock:
            live = [
                PeerInfo(worker_id=worker_id, url=peer.url, version=peer.version)
                for worker_id, peer in self._peers.items()
                if worker_id != asker
                and now - peer.seen < PEER_TTL_SECONDS
                and not self.banned(worker_id)
                and asker not in self._reports.get(worker_id, ())
            ]
        return sorted(live, key=lambda peer: -peer.version)[:MAX_LISTED]

    def report(self, reporter: str, body: PeerReport) -> None:
        """Record one report durably (an event row) and count it against the peer."""
        with self.context.store.transaction() as db, self._lock:
            reason = f"{reporter} chunk {body.sha256[:16]}: {body.reason}"
            add_event(db, self.context.clock(), PEER_MISBEHAVED, body.worker_id, reason)
            self._count(db, reporter, body.worker_id)
            if self.banned(body.worker_id):
                self._peers.pop(body.worker_id, None)

    def reports(self, worker_id: str) -> int:
        return len(self._reports.get(worker_id, ()))


def check_peer_url(url: str, address: str) -> None:
    """Refuse (422) a peer URL other workers must not be sent to (see the module docstring)."""
    host = urlsplit(url).hostname or ""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ApiError(
            422, f"peer url {url!r} must name an IP address, not {host!r}", Reason.PEER_URL
        ) from None
    if ip.is_link_local or ip.is_multicast or ip.is_unspecified or ip.is_reserved:
        raise ApiError(422, f"peer url {url!r}: {ip} is not an address peers may be sent to", Reason.PEER_URL)
    try:
        caller = ipaddress.ip_address(address)
        local_caller = caller.is_private or caller.is_loopback
    except ValueError:
        local_caller = False
    if (ip.is_private or ip.is_loopback) and not local_caller:
        detail = f"peer url {url!r}: a private address, announced from the public address {address}"
        raise ApiError(422, detail, Reason.PEER_URL)
