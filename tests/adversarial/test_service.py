"""The service and identity layers under attack from outsiders and from other workers.

A real coordinator process on loopback (the `Arena`), hostile raw sockets and hostile signed
clients; an honest worker alongside each attack must keep at least 70 % of its attack-free rate,
and nothing another party can send may cost an honest worker its standing.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from adversarial.processes import confident_arena
from benchmarks.adversarial.arena import Arena
from benchmarks.adversarial.attacks import submit
from benchmarks.adversarial.floods import (
    disconnects_counted,
    failed_auth_flood,
    fresh_hoarders,
    oversized_submissions,
    slow_bodies,
)
from benchmarks.adversarial.outsiders import address, honest_rate, hostile_sockets, status_of
from decentrl.protocol import API_PREFIX, LeaseRequest, PeerAnnounce, PeerReport
from decentrl.trust.identity import Signer

pytestmark = pytest.mark.integration

HEADER_TIMEOUT = 2.0
SNAPSHOT_ASKS = 3
OVERRIDES = [
    "coordinator.group_size=4",
    "coordinator.max_pending_groups=64",
    "trust.verify_fraction=0.0",  # the verifier's pace is not what these tests measure
    f"service.header_timeout_seconds={HEADER_TIMEOUT}",
    "service.max_connections=256",
    "service.max_connections_per_address=32",
    f"weights.snapshot_requests_per_hour={SNAPSHOT_ASKS}",
    'weights.peer_networks=["127.0.0.0/8"]',  # the peers below listen on loopback
    # The honest worker's own request rate must not be what its rate measures: at the default 20 a
    # second (burst 60) its lease-and-submit loop of 4 rollouts is capped at 40 rollouts/s, below
    # what it does unlimited here (85-100), so an attack-free baseline taken on a full burst and a
    # rate under attack taken on a drained one differed by the burst alone (ratios 0.67-0.93;
    # honest rate 40.3-40.6 under attack in every run).
    "trust.requests_per_second=200",
    "trust.request_burst=200",
]
MIN_RATE_KEPT = 0.7


@pytest.fixture(scope="module")
def arena(tmp_path_factory: pytest.TempPathFactory):
    with confident_arena(tmp_path_factory, OVERRIDES, num_versions=2) as arena:
        yield arena


@pytest.fixture(scope="module")
def honest(arena: Arena):
    agent = arena.agent("honest")
    honest_rate(agent, 1.0)  # warm up the engine and the connection
    yield agent
    agent.close()


@pytest.mark.slow  # CI time: `make test-all` runs it
def test_idle_and_slow_connections_neither_stop_the_service_nor_stay_open(arena: Arena, honest) -> None:
    """1,100 idle connections over 40 source addresses plus 40 that send their request head one byte
    every half second: honest work and `/v1/health` go on, and the server closes the hostile
    sockets after its header deadline."""
    baseline = honest_rate(honest, 3.0)
    with hostile_sockets(arena.url) as sockets:
        sockets.open(1100, addresses=40)
        sockets.trickle(40)
        health = [httpx.get(f"{arena.url}{API_PREFIX}/health", timeout=5).status_code for _ in range(5)]
        attacked = honest_rate(honest, 3.0)
        time.sleep(HEADER_TIMEOUT + 1.0)
        closed = sockets.closed_by_server()
    assert health == [200] * 5
    print(f"honest rate kept under idle and slow connections: {attacked / baseline:.2f}")
    assert attacked >= MIN_RATE_KEPT * baseline, (attacked, baseline)
    assert closed >= 0.95, closed


def test_replays_and_junk_signatures_do_not_frame_the_key_holder(arena: Arena, honest) -> None:
    """An observer replays a captured signed request and sends junk signatures with the victim's
    token from its own address, ten times each: 401s, no strike, and the victim keeps working."""
    victim = arena.agent("victim")
    observer = httpx.Client(transport=httpx.HTTPTransport(local_address=address(300)), timeout=10)
    try:
        body = LeaseRequest(policy_version=arena.latest, max_groups=1).model_dump_json().encode()
        path = f"{API_PREFIX}/leases"
        captured = {
            "Authorization": f"Bearer {victim.client.token}",
            "Content-Type": "application/json",
            **victim.signer.headers("POST", path, body),
        }
        assert httpx.post(arena.url + path, content=body, headers=captured).status_code == 200
        statuses = [
            observer.post(arena.url + path, content=body, headers=captured).status_code for _ in range(10)
        ]
        junk = {**captured, **Signer(Ed25519PrivateKey.generate()).headers("POST", path, body)}
        statuses += [
            observer.post(arena.url + path, content=body, headers=junk).status_code for _ in range(10)
        ]
        assert statuses == [401] * 20
        assert arena.query(
            "SELECT COUNT(*) FROM events WHERE kind = 'violation' AND worker_id = ?", victim.worker_id
        ) == [(0,)]
        assert arena.quarantined(victim.worker_id) is None
        assert honest_rate(victim, 1.0) > 0
    finally:
        observer.close()
        victim.close()


def test_registering_someone_elses_public_key_needs_its_private_key(arena: Arena) -> None:
    victim = arena.agent("victim")
    url, enroll = f"{arena.url}{API_PREFIX}/workers", {"Authorization": f"Bearer {arena.enroll_token}"}

    def challenge() -> str:
        return httpx.post(f"{url}/challenge").json()["challenge"]

    def register(**fields: str) -> httpx.Response:
        body = {"name": "claim", "public_key": victim.signer.public_key, **fields}
        return httpx.post(f"{url}/register", json=body, headers=enroll)

    try:
        assert register().status_code == 401  # the public key alone
        forged = challenge()
        assert (
            register(challenge=forged, proof=Signer(Ed25519PrivateKey.generate()).prove(forged)).status_code
            == 401
        )
        # The key holder registers again (a new token, the same identity); its request, captured and
        # sent again, is refused: a challenge is spent by its first use.
        fresh = challenge()
        answer = register(challenge=fresh, proof=victim.signer.prove(fresh))
        assert answer.status_code == 200 and answer.json()["worker_id"] == victim.worker_id
        victim.client.token = answer.json()["token"]
        assert register(challenge=fresh, proof=victim.signer.prove(fresh)).status_code == 401
        assert arena.query(
            "SELECT COUNT(*) FROM worker_keys WHERE public_key = ?", victim.signer.public_key
        ) == [(1,)]
        assert victim.lease(1).tasks
    finally:
        victim.close()


def test_lease_hoarding_holds_no_more_than_the_floor(arena: Arena, honest) -> None:
    """A worker that asks for 256 groups every 100 ms and never answers holds at most
    `trust.lease_groups_floor` of them; the honest worker keeps its rate."""
    baseline = honest_rate(honest, 3.0)
    hoarder, stop = arena.agent("hoarder"), threading.Event()
    request = LeaseRequest(policy_version=arena.latest, max_groups=256)

    def hoard() -> None:
        while not stop.wait(0.1):
            hoarder.client.lease(request)

    thread = threading.Thread(target=hoard, daemon=True)
    thread.start()
    try:
        time.sleep(1.0)
        attacked = honest_rate(honest, 3.0)
        held = arena.query(
            "SELECT COUNT(DISTINCT ls.task_id) FROM leases l JOIN lease_slots ls ON ls.lease_id = l.lease_id"
            " WHERE l.worker_id = ? AND l.state = 'open'",
            hoarder.worker_id,
        )[0][0]
    finally:
        stop.set()
        thread.join(timeout=10)
        hoarder.close()
    assert held <= arena.config.trust.lease_groups_floor, held
    print(f"honest rate kept under lease hoarding: {attacked / baseline:.2f}")
    assert attacked >= MIN_RATE_KEPT * baseline, (attacked, baseline)


def test_free_form_fields_have_a_size_budget(arena: Arena) -> None:
    """A megabyte of transcript in an otherwise honest rollout is refused (413) and stores nothing."""
    agent = arena.agent("padder")
    try:
        rollouts = agent.play(agent.lease(1))
        rollouts[0].transcript = [{"note": "x" * 1_000_000}]
        assert submit(agent, rollouts) == 413
        assert arena.stored(agent.worker_id) == 0
    finally:
        agent.close()


def test_fresh_identities_cannot_ban_a_peer_nor_announce_unroutable_urls(arena: Arena) -> None:
    """Three new identities report an honest peer: it stays listed to everybody but its reporters.
    A link-local URL (a cloud metadata service, for instance) is refused at the announcement."""
    peer, asker = arena.agent("peer"), arena.agent("asker")
    reporters = [arena.agent(f"reporter{i}") for i in range(3)]
    try:
        peer.client.announce_peer(PeerAnnounce(url="http://127.0.0.1:9", version=arena.latest))
        for reporter in reporters:
            reporter.client.report_peer(
                PeerReport(worker_id=peer.worker_id, sha256="0" * 64, reason="bad bytes")
            )
        assert peer.worker_id in [listed.worker_id for listed in asker.client.peers()]
        assert peer.worker_id not in [listed.worker_id for listed in reporters[0].client.peers()]
        for url in ("http://169.254.169.254:80", "http://[fe80::1]:80", "http://224.0.0.1:80"):
            assert (
                status_of(lambda url=url: peer.client.announce_peer(PeerAnnounce(url=url, version=0))) == 422
            )
    finally:
        for agent in (peer, asker, *reporters):
            agent.close()


def signed_post(agent, path: str, body: dict) -> int:  # noqa: ANN001 - an arena agent
    """Status of a signed POST of a raw JSON body (one the client's own models would not build)."""
    data = json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {agent.client.token}", "Content-Type": "application/json"}
    headers |= agent.signer.headers("POST", path, data)
    return httpx.post(agent.arena.url + path, content=data, headers=headers).status_code


def test_peer_announcements_name_a_routable_address_a_published_version_and_no_path(arena: Arena) -> None:
    """Internal addresses outside `weights.peer_networks` (loopback only here), a path or query of
    the announcer's choosing, a version above the latest or past any column: 422, nothing listed."""
    peer, asker = arena.agent("announcer"), arena.agent("announce-asker")
    path = f"{API_PREFIX}/weights/peers"
    try:
        for url in (
            "http://100.100.100.200:80",
            "http://100.64.0.1:80",
            "http://[fec0::1]:80",
            "http://10.0.0.1:80",
        ):
            assert signed_post(peer, path, {"url": url, "version": arena.latest}) == 422, url
        for url in (
            "http://127.0.0.1:9/latest/meta-data",
            "http://127.0.0.1:9?token=x",
            "http://127.0.0.1:9/",
        ):
            assert signed_post(peer, path, {"url": url, "version": arena.latest}) == 422, url
        for version in (arena.latest + 1, 2**62, 2**63):
            assert signed_post(peer, path, {"url": "http://127.0.0.1:9", "version": version}) == 422, version
        assert peer.worker_id not in [listed.worker_id for listed in asker.client.peers()]
        assert signed_post(peer, path, {"url": "http://127.0.0.1:9", "version": arena.latest}) == 200
        assert peer.worker_id in [listed.worker_id for listed in asker.client.peers()]
    finally:
        peer.close()
        asker.close()


def test_control_and_bidi_characters_in_client_text_are_schema_errors(arena: Arena) -> None:
    """An engine name or a peer-report reason that would forge a log line or reorder what an
    operator reads: 422 at the schema, nothing recorded."""
    agent = arena.agent("texter")
    url, enroll = f"{arena.url}{API_PREFIX}/workers", {"Authorization": f"Bearer {arena.enroll_token}"}

    def register(engine: str) -> int:
        signer = Signer(Ed25519PrivateKey.generate())
        challenge = httpx.post(f"{url}/challenge").json()["challenge"]
        body = {"name": "texter", "engine": engine, "public_key": signer.public_key}
        body |= {"challenge": challenge, "proof": signer.prove(challenge)}
        return httpx.post(f"{url}/register", json=body, headers=enroll).status_code

    try:
        assert [register(engine) for engine in ("hf\u202egnp.exe", "hf\nWARNING forged", "hf")] == [
            422,
            422,
            200,
        ]
        report = {"worker_id": agent.worker_id, "sha256": "0" * 64, "reason": "bad\nforged event"}
        assert signed_post(agent, f"{API_PREFIX}/weights/peers/report", report) == 422
        assert arena.query(
            "SELECT COUNT(*) FROM events WHERE kind = 'peer_misbehaved' AND worker_id = ?", agent.worker_id
        ) == [(0,)]
    finally:
        agent.close()


def test_lax_numbers_and_huge_integers_are_refused_as_schema_errors(arena: Arena, honest) -> None:
    """JSON `true` is no number and 2**63 fits no database column: 422, never a 500."""
    lease = honest.lease(1)
    rollout = json.loads(honest.play(lease)[0].model_dump_json())
    path = f"{API_PREFIX}/rollouts"
    for field, value in (
        ("slot", 2**63),
        ("slot", True),
        ("sampling", {"temperature": True, "max_new_tokens": 8}),
    ):
        body = json.dumps({"rollouts": [{**rollout, field: value}]}).encode()
        headers = {"Authorization": f"Bearer {honest.client.token}", "Content-Type": "application/json"}
        headers |= honest.signer.headers("POST", path, body)
        assert httpx.post(arena.url + path, content=body, headers=headers).status_code == 422, field
    trainer = {"Authorization": f"Bearer {arena.trainer_token}"}
    metrics = {"policy_version": 2**63, "metrics": {"loss": 1.0}}
    assert (
        httpx.post(f"{arena.url}{API_PREFIX}/trainer/metrics", json=metrics, headers=trainer).status_code
        == 422
    )


@pytest.mark.slow  # CI time: `make test-all` runs it
def test_bad_tokens_from_many_addresses_write_few_events(arena: Arena) -> None:
    """200 requests with made-up tokens from 20 addresses: each is refused, and the refusals are
    recorded as at most one event per second per reason (the rest counted in memory)."""
    before = arena.query("SELECT COUNT(*) FROM events")[0][0]
    started = time.monotonic()
    for index in range(20):
        with httpx.Client(transport=httpx.HTTPTransport(local_address=address(index))) as client:
            for _ in range(10):
                answer = client.get(
                    f"{arena.url}{API_PREFIX}/info", headers={"Authorization": "Bearer made-up"}
                )
                assert answer.status_code in (401, 429)
    seconds = time.monotonic() - started
    written = arena.query("SELECT COUNT(*) FROM events")[0][0] - before
    assert written <= 2 * (seconds + 2), (written, seconds)


def test_snapshot_requests_cannot_turn_deltas_into_snapshots(arena: Arena) -> None:
    """Workers asking for a full snapshot after every version: each answer waits for
    `weights.min_snapshot_interval` versions after the newest snapshot, however many ask, and one
    worker asking past its hourly allowance gets 429."""
    askers = [arena.agent(f"snapshot-{index}") for index in range(3)]
    askers[0].client.retry_rate_limited = False
    try:
        answers = [asker.client.request_snapshot() for asker in askers]
        due = answers[0]["snapshot"] + arena.config.weights.min_snapshot_interval
        assert all(answer["pending"] and answer["next_at"] == due for answer in answers), answers
        assert due > arena.latest + 1  # the trainer's next version stays a delta
        not_before = arena.query("SELECT value FROM meta WHERE key = 'snapshot_not_before'")
        assert not_before == [(str(due),)]
        statuses = [status_of(askers[0].client.request_snapshot) for _ in range(SNAPSHOT_ASKS)]
        assert statuses == [200] * (SNAPSHOT_ASKS - 1) + [429], statuses
    finally:
        for asker in askers:
            asker.close()


def test_slow_bodies_from_one_token_hold_only_its_share_of_request_slots(arena: Arena, honest) -> None:
    """300 signed submissions with one worker's token over 10 addresses, their bodies a byte a
    second: the token holds `service.max_requests_per_token` slots, the rest are refused at once; the
    honest worker keeps its rate, and the clients that leave mid-body are counted, not traced."""
    figure = slow_bodies(arena, honest, 3.0)
    print(f"honest rate kept under 300 slow bodies from one token: {figure['ratio']:.2f} ({figure})")
    assert figure["ratio"] >= MIN_RATE_KEPT, figure
    assert disconnects_counted(arena) >= 1
    assert "ClientDisconnect" not in arena.coordinator.log_path.read_text()


def test_fresh_identities_hoarding_leases_leave_room_for_honest_work(arena: Arena, honest) -> None:
    """Four new identities asking for 256 groups every 100 ms and never answering hold their
    newcomer's quota each, and `max_pending_groups` keeps room for the honest worker."""
    figure = fresh_hoarders(arena, honest, 3.0)
    print(f"honest rate kept under four fresh hoarders: {figure['ratio']:.2f} ({figure})")
    assert figure["groups_held"] <= 4 * arena.config.trust.lease_groups_new, figure
    assert figure["ratio"] >= MIN_RATE_KEPT, figure


def test_oversized_submissions_are_refused_before_parsing(arena: Arena, honest) -> None:
    """Submissions of 4,001 rollouts from a worker holding one group: 413 after reading the bytes of
    the slots it holds, nothing parsed; the honest worker keeps its rate."""
    figure = oversized_submissions(arena, honest, 3.0)
    print(f"honest rate kept under oversized submissions: {figure['ratio']:.2f} ({figure})")
    assert figure["statuses"] == [413], figure
    assert figure["ratio"] >= MIN_RATE_KEPT, figure


@pytest.mark.slow  # CI time: `make test-all` runs it
def test_failed_authentications_from_many_addresses_stay_cheap(arena: Arena, honest) -> None:
    """Made-up tokens from 50 addresses as fast as eight threads send them: each address is refused
    before any lookup once its failed authentications are spent; the honest worker keeps its rate."""
    figure = failed_auth_flood(arena, honest, 3.0)
    print(f"honest rate kept under a failed-auth flood from 50 addresses: {figure['ratio']:.2f} ({figure})")
    assert set(figure["statuses"]) <= {401, 429}, figure
    assert figure["ratio"] >= MIN_RATE_KEPT, figure
