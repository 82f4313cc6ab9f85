"""Peer lists for weight chunks: which workers serve chunks, and which misbehaved.

Workers that accept connections announce their chunk server (`http://IP:PORT`; the fetcher builds
the path) and the version they hold, which may not be above the latest published one; the
coordinator hands the list to other workers. Announcements and reports live in the store (`peers`,
`peer_reports`), so every replica of a run over PostgreSQL lists the same peers and a restart
forgets nothing; workers also re-announce after every version and on a timer. A peer reported for
serving bytes that do not match a chunk's hash gets an event row and is never listed to its
reporter again; after `MAX_REPORTS` reports from distinct *established* workers (past their
probation: `trust.probation_tokens` verified tokens when they report, which sybils made for the
purpose do not have) it is listed to nobody. Workers check every chunk's hash anyway: a listing is
an offer, never trust.

A list holds `MAX_LISTED` peers: established ones first (a claimed version or a fresh identity costs
nothing, verified tokens do), at most `MAX_PER_HOST` per address, in random order within each rank,
so that identities made by the dozen cannot crowd the workers that did real work off the list.

Stage trainers of a run whose coordinator keeps no chunks (`weights.store = "peers"`) announce their
chunk servers with the trainer token; the coordinator keeps those in memory (each re-announces after
every version) and lists them first, as established peers, to everyone.

An announced address must be one other workers may be sent to: globally routable, or inside one of
`weights.peer_networks` (a private fleet's network; the local launcher adds loopback), and never
link-local, multicast or unspecified (a cloud metadata service sits at a link-local address).
"""

from __future__ import annotations

import ipaddress
import random
import re
from collections import Counter
from urllib.parse import urlsplit

from decentrl.coordinator.context import Context
from decentrl.coordinator.db.store import add_event
from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.coordinator.trust.reputation import tokens_verified
from decentrl.protocol import PEER_ADDRESS, PeerAnnounce, PeerInfo, PeerReport, TrainerPeerAnnounce

PEER_MISBEHAVED = "peer_misbehaved"
MAX_REPORTS = 3
"""Reports (from distinct established reporters) that take a peer off the lists."""
PEER_TTL_SECONDS = 120.0
MAX_LISTED = 32
MAX_PER_HOST = 2
"""Listed peers per IP address: sybils served from one machine take two places, not the list."""
NAT64 = ipaddress.ip_network("64:ff9b::/96")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
ESTABLISHED = "SELECT COUNT(*) FROM peer_reports WHERE peer = ? AND established = 1"
LISTING = (
    "SELECT p.worker_id, p.url, p.version, COALESCE(q.tokens_verified, 0) AS verified FROM peers p"
    " LEFT JOIN reputation q ON q.worker_id = p.worker_id"
    " WHERE p.worker_id != ? AND p.seen > ? AND q.quarantined IS NULL"
    " AND (SELECT COUNT(*) FROM peer_reports r WHERE r.peer = p.worker_id AND r.established = 1) < ?"
    " AND NOT EXISTS (SELECT 1 FROM peer_reports r WHERE r.peer = p.worker_id AND r.reporter = ?)"
)


class PeerTable:
    def __init__(self, context: Context):
        self.context = context
        self.networks = [ipaddress.ip_network(net) for net in context.run.weights.peer_networks]
        self._random = random.Random()
        self.trainers: dict[int, TrainerPeerAnnounce] = {}
        """Each stage trainer's chunk server, by stage (`weights.store = "peers"`)."""
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

    def announce(self, worker_id: str, body: PeerAnnounce) -> None:
        check_peer_url(body.url, self.networks)
        now = self.context.clock()
        with self.context.store.transaction() as db:
            latest = db.execute("SELECT MAX(version) FROM weights").fetchone()[0]
            # Checked, not trusted: a claim above every published version is a lie on its face.
            if body.version > (-1 if latest is None else latest):
                detail = f"peer version {body.version} is above the latest published one ({latest})"
                raise ApiError(422, detail, Reason.UNKNOWN_VERSION)
            db.execute(
                "INSERT OR REPLACE INTO peers (worker_id, url, version, seen) VALUES (?, ?, ?, ?)",
                (worker_id, body.url, body.version, now),
            )
            db.execute("DELETE FROM peers WHERE seen < ?", (now - PEER_TTL_SECONDS,))

    def announce_trainer(self, body: TrainerPeerAnnounce) -> None:
        check_peer_url(body.url, self.networks)
        stage_map = self.context.stage_map
        if stage_map is None or body.stage >= stage_map.num_stages:
            raise ApiError(422, f"stage {body.stage} is not a stage of this run", Reason.SCHEMA)
        self.trainers[body.stage] = body

    def listing(self, asker: str) -> list[PeerInfo]:
        cutoff = self.context.clock() - PEER_TTL_SECONDS
        probation = self.context.run.trust.probation_tokens
        with self.context.store.transaction() as db:
            rows = db.execute(LISTING, (asker, cutoff, MAX_REPORTS, asker)).fetchall()
            latest = db.execute("SELECT MAX(version) FROM weights").fetchone()[0]
        peers = [
            PeerInfo(worker_id=row[0], url=row[1], version=row[2], established=row[3] >= probation)
            for row in rows
            if allowed(row[1], self.networks)  # the allowlist may have shrunk since it was announced
        ]
        self._random.shuffle(peers)
        peers.sort(key=lambda peer: (not peer.established, peer.version != latest))
        per_host: Counter[str | None] = Counter()
        listed = []
        for peer in peers:
            host = urlsplit(peer.url).hostname
            per_host[host] += 1
            if per_host[host] <= MAX_PER_HOST:
                listed.append(peer)
        trainers = [
            PeerInfo(
                worker_id=f"stage-trainer-{stage}",
                url=body.url,
                version=body.version,
                established=True,
                seeder=True,
            )
            for stage, body in sorted(self.trainers.items())
        ]
        return [*trainers, *listed][:MAX_LISTED]

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


def _embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries (mapped, 6to4, Teredo, NAT64), which is where a
    connection to it may end up."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip in NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)


def _refusal(ip: IPAddress, networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> str | None:
    """Why other workers must not be sent to `ip`; None if they may."""
    inner = _embedded_ipv4(ip)
    if inner is not None:
        return _refusal(inner, networks)
    if ip.is_link_local or ip.is_multicast or ip.is_unspecified:
        return "a link-local, multicast or unspecified address"
    if any(ip in network for network in networks):
        return None
    # `is_global` alone lets IPv6 site-local addresses (fec0::/10, deprecated but routed
    # internally) through in the Python this runs on.
    if not ip.is_global or (isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local):
        return "not globally routable and not in weights.peer_networks"
    return None


def check_peer_url(url: str, networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> None:
    """Refuse (422) a peer address other workers must not be sent to (see the module docstring)."""
    host = urlsplit(url).hostname or ""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ApiError(
            422, f"peer url {url!r} must name an IP address, not {host!r}", Reason.PEER_URL
        ) from None
    problem = _refusal(ip, networks)
    if problem is not None:
        raise ApiError(422, f"peer url {url!r}: {ip} is {problem}", Reason.PEER_URL)


def allowed(url: str, networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> bool:
    if re.fullmatch(PEER_ADDRESS, url) is None:  # a row announced under looser rules
        return False
    try:
        check_peer_url(url, networks)
    except ApiError:
        return False
    return True
