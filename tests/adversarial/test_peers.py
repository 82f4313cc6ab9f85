"""The peer-to-peer weight path under attack from other workers: sybil identities that announce
chunk servers which trickle or flood, and claim versions nobody published.

A real coordinator process on loopback (the `Arena`). Two honest workers past their probation serve
the latest version's chunks; forty fresh identities announce hostile servers, each on a loopback
address of its own (an attacker with many hosts). An honest newcomer fetching the latest version
must keep at least 70 % of the rate it gets with the honest peers alone, and get every byte right.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from adversarial.processes import confident_arena
from benchmarks.adversarial.arena import Agent, Arena
from benchmarks.adversarial.outsiders import honest_rate, status_of
from benchmarks.adversarial.peers import HostilePeer, Misbehaviour
from decentrl.coordinator.weights.peers import MAX_PER_HOST
from decentrl.protocol import MAX_VERSION, PeerAnnounce, PeerInfo
from decentrl.weights.chunks import ChunkStore
from decentrl.weights.peer_server import PeerServer
from decentrl.weights.signing import parse_public_key
from decentrl.weights.sync import WeightSync
from decentrl.weights.transfer import ChunkFetcher

pytestmark = pytest.mark.integration

PROBATION_TOKENS = 8
SYBILS = 40
OVERRIDES = [
    "coordinator.group_size=4",
    "coordinator.max_pending_groups=64",
    f"trust.probation_tokens={PROBATION_TOKENS}",
    "weights.chunk_bytes=4096",  # several chunks a manifest, so that peers serve most of a version
    'weights.peer_networks=["127.0.0.0/8"]',  # every peer here listens on loopback
]
MIN_RATE_KEPT = 0.7
ROUNDS = 5


@pytest.fixture(scope="module")
def arena(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Arena]:
    with confident_arena(tmp_path_factory, OVERRIDES, num_versions=4) as arena:
        yield arena


def verified_tokens(arena: Arena, agent: Agent) -> int:
    rows = arena.query("SELECT tokens_verified FROM reputation WHERE worker_id = ?", agent.worker_id)
    return rows[0][0] if rows else 0


def establish(arena: Arena, agent: Agent) -> None:
    """Honest work until the verifier has checked `PROBATION_TOKENS` of the agent's tokens."""
    deadline = time.monotonic() + 60
    while verified_tokens(arena, agent) < PROBATION_TOKENS:
        assert time.monotonic() < deadline, "the verifier did not take the agent past its probation"
        honest_rate(agent, 0.5)
        arena.settle()


def weight_sync(arena: Arena, agent: Agent, root: Path) -> WeightSync:
    key = parse_public_key(arena.trainer.info().trainer_public_key)
    return WeightSync(agent.client, key, ChunkFetcher(agent.client, ChunkStore(root, durable=False)))


def timed_sync(arena: Arena, agent: Agent, root: Path, peers: list[PeerInfo]) -> tuple[float, WeightSync]:
    """Seconds a fresh worker store takes to reach the latest version with `peers` listed (in a
    thread with a bound, so that a fetcher held by a hostile peer fails the test, not hangs it)."""
    sync = weight_sync(arena, agent, root)
    sync.fetcher.peers = peers
    started = time.perf_counter()
    thread = threading.Thread(target=sync.sync_to, args=(arena.latest,), daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the fetch did not finish within a minute"
    return time.perf_counter() - started, sync


# Before the swarm below: its 42 announced peers would fill the capped list this test reads.
def test_identities_behind_one_address_take_two_places_on_a_list(arena: Arena) -> None:
    """Five identities announcing chunk servers on one IP address (different ports): a list names
    at most `MAX_PER_HOST` of them, whatever they claim."""
    agents = [arena.agent(f"cohost{i}") for i in range(5)]
    asker = arena.agent("cohost-asker")
    try:
        for port, agent in enumerate(agents, start=9000):
            agent.client.announce_peer(PeerAnnounce(url=f"http://127.0.2.1:{port}", version=arena.latest))
        listed = [peer for peer in asker.client.peers() if peer.url.startswith("http://127.0.2.1:")]
        assert len(listed) == MAX_PER_HOST, listed
    finally:
        for agent in [*agents, asker]:
            agent.close()


@dataclass
class Swarm:
    honest: list[Agent]
    victim: Agent
    hostile: list[HostilePeer]
    listing: list[PeerInfo]


@pytest.fixture(scope="module")
def swarm(arena: Arena, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    """Two established seeders serving the latest version, `SYBILS` fresh identities announcing
    hostile servers (half trickle, half flood; the flooders first claim a version nobody published),
    and the peer list an honest newcomer gets."""
    tmp_path = tmp_path_factory.mktemp("swarm")
    with ExitStack() as stack:
        honest = [arena.agent(f"seeder{i}") for i in range(2)]
        victim = arena.agent("newcomer")
        for agent in [*honest, victim]:
            stack.callback(agent.close)
        for index, agent in enumerate(honest):
            establish(arena, agent)
            seeded = weight_sync(arena, agent, tmp_path / f"seeder{index}")
            seeded.sync_to(arena.latest)
            server = PeerServer(seeded.store).start()
            stack.callback(server.stop)
            agent.client.announce_peer(PeerAnnounce(url=server.url, version=arena.latest))
        digests = seeded.store.digests()

        sybils = [arena.agent(f"sybil{i}") for i in range(SYBILS)]
        hostile = []
        for index, sybil in enumerate(sybils):
            stack.callback(sybil.close)
            behaviour = (Misbehaviour.TRICKLE, Misbehaviour.FLOOD)[index % 2]
            hostile.append(HostilePeer(behaviour, digests, host=f"127.0.1.{1 + index}"))
            stack.callback(hostile[-1].stop)
            claim = PeerAnnounce(url=hostile[-1].url, version=MAX_VERSION if index % 2 else arena.latest)
            assert status_of(lambda claim=claim, sybil=sybil: sybil.client.announce_peer(claim)) == (
                422 if index % 2 else 200
            )
            if index % 2:  # refused for a version nobody published, it claims the latest instead
                sybil.client.announce_peer(PeerAnnounce(url=hostile[-1].url, version=arena.latest))
        yield Swarm(honest, victim, hostile, victim.client.peers())


def test_sybil_peers_do_not_crowd_established_ones_off_the_list(arena: Arena, swarm: Swarm) -> None:
    """40 fresh identities, half of them first claiming version 2^62: the list still names both
    established peers, first, and no claim above the latest published version."""
    assert len(swarm.listing) == 32
    assert {agent.worker_id for agent in swarm.honest} <= {peer.worker_id for peer in swarm.listing}
    assert [peer.established for peer in swarm.listing[:2]] == [True, True]
    assert all(peer.version <= arena.latest for peer in swarm.listing)


@pytest.mark.slow  # ten timed fetches of the whole model (about a minute here)
def test_sybil_peers_that_trickle_or_flood_cost_an_honest_fetch_little(
    arena: Arena, swarm: Swarm, tmp_path: Path
) -> None:
    honest_ids = {agent.worker_id for agent in swarm.honest}
    listing, victim = swarm.listing, swarm.victim
    alone, attacked = [], []
    for round_ in range(ROUNDS):
        seconds, sync = timed_sync(
            arena, victim, tmp_path / f"alone{round_}", [p for p in listing if p.worker_id in honest_ids]
        )
        alone.append(seconds)
        seconds, sync = timed_sync(arena, victim, tmp_path / f"attacked{round_}", listing)
        attacked.append(seconds)
        assert sync.version == arena.latest  # its reconstructed state matched the signed hash
        assert sum(sync.fetcher.bytes_from[p] for p in honest_ids) > 0
    kept = statistics.median(alone) / statistics.median(attacked)
    print(
        f"honest fetch rate kept under {SYBILS} sybil peers: {kept:.2f} (alone {alone}, attacked {attacked})"
    )
    assert sum(peer.requests for peer in swarm.hostile) == 0
    assert kept >= MIN_RATE_KEPT, (alone, attacked)
