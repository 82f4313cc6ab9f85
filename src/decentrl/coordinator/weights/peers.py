"""Peer lists for weight chunks: which workers serve chunks, and which misbehaved.

Workers that accept connections announce their chunk server's URL and the version they hold;
the coordinator hands the list to other workers. Announcements and reports live in the store
(`peers`, `peer_reports`), so every replica of a run over PostgreSQL lists the same peers and a
restart forgets nothing; workers also re-announce after every version and on a timer. A peer
reported for serving bytes that do not match a chunk's hash gets an event row and is never listed
to its reporter again; after `MAX_REPORTS` reports from distinct *established* workers (past their
probation: `trust.probation_tokens` verified tokens when they report, which sybils made for the
purpose do not have) it is listed to nobody. Workers check every chunk's hash anyway: a listing is
an offer, never trust.

An announced URL must name an IP address (no name to re-resolve elsewhere later) that other workers
may be sent to: never link-local, multicast, unspecified or reserved, and a loopback or private
address only from a worker that itself connects from one (a local or LAN deployment).
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from decentrl.coordinator.context import Context
from decentrl.coordinator.db.store import add_event
from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.coordinator.trust.reputation import tokens_verified
from decentrl.protocol import PeerAnnounce, PeerInfo, PeerReport

PEER_MISBEHAVED = "peer_misbehaved"
MAX_REPORTS = 3
"""Reports (from distinct established reporters) that take a peer off the lists."""
PEER_TTL_SECONDS = 120.0
MAX_LISTED = 32

ESTABLISHED = "SELECT COUNT(*) FROM peer_reports WHERE peer = ? AND established = 1"
LISTING = (
    "SELECT p.worker_id, p.url, p.version FROM peers p WHERE p.worker_id != ? AND p.seen > ?"
    " AND (SELECT COUNT(*) FROM peer_reports r WHERE r.peer = p.worker_id AND r.established = 1) < ?"
    " AND NOT EXISTS (SELECT 1 FROM peer_reports r WHERE r.peer = p.worker_id AND r.reporter = ?)"
    " ORDER BY p.version DESC, p.worker_id LIMIT ?"
)


class PeerTable:
    def __init__(self, context: Context):
        self.context = context
        with context.store.transaction() as db:
            # Reports recorded only as events (a run directory older than the `peer_reports` table).
            rows = db.execute(
                "SELECT worker_id, reason FROM events WHERE kind = ?", (PEER_MISBEHAVED,)
            ).fetchall()
            for row in rows:
                self._count(db, row["reason"].split(" ", 1)[0], row["worker_id"])

    def _count(self, db, reporter: str, peer: str) -> None:  # noqa: ANN001 - a store connection
        established = tokens_verified(db, reporter) >= self.context.run.trust.probation_tokens
        db.execute(
            "INSERT OR IGNORE INTO peer_reports (peer, reporter, established) VALUES (?, ?, ?)",
            (peer, reporter, int(established)),
        )

    def announce(self, worker_id: str, body: PeerAnnounce, address: str = "") -> None:
        check_peer_url(body.url, address)
        now = self.context.clock()
        with self.context.store.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO peers (worker_id, url, version, seen) VALUES (?, ?, ?, ?)",
                (worker_id, body.url, body.version, now),
            )
            db.execute("DELETE FROM peers WHERE seen < ?", (now - PEER_TTL_SECONDS,))

    def listing(self, asker: str) -> list[PeerInfo]:
        cutoff = self.context.clock() - PEER_TTL_SECONDS
        with self.context.store.transaction() as db:
            rows = db.execute(LISTING, (asker, cutoff, MAX_REPORTS, asker, MAX_LISTED)).fetchall()
        return [PeerInfo(worker_id=row[0], url=row[1], version=row[2]) for row in rows]

    def report(self, reporter: str, body: PeerReport) -> dict:
        """Record one report durably (an event row) and count it against the peer; the peer's
        report count and whether it is now off every list."""
        with self.context.store.transaction() as db:
            reason = f"{reporter} chunk {body.sha256[:16]}: {body.reason}"
            add_event(db, self.context.clock(), PEER_MISBEHAVED, body.worker_id, reason)
            self._count(db, reporter, body.worker_id)
            reports = db.execute(
                "SELECT COUNT(*) FROM peer_reports WHERE peer = ?", (body.worker_id,)
            ).fetchone()[0]
            banned = db.execute(ESTABLISHED, (body.worker_id,)).fetchone()[0] >= MAX_REPORTS
        return {"reports": int(reports), "banned": banned}


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
