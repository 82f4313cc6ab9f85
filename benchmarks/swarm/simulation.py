"""The swarm simulation: 10,000 workers running the real worker loop against a model of the run.

Each worker does what `worker/loop.py` does: ask for the latest version; if behind, fetch the route
the real catch-up planner (`weights/planner.py`) picks from the retained index and wait for it; lease
one group; generate it; upload the submission. The coordinator's rules are the real ones: no lease
beyond `max_pending_groups` untrained groups, a submission whose oldest token is more than
`max_staleness` versions behind the latest is rejected, and the trainer drops groups that are too
stale when it takes its batch. The trainer takes a batch whenever one is ready, trains for
`step_seconds` and publishes the next version. Time advances in fixed ticks (the bandwidth model is
a fluid, see `bandwidth.py`); every worker is a row of numpy arrays.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from benchmarks.swarm import bandwidth
from benchmarks.swarm.fleet import MBIT, Fleet, SwarmConfig, draw_fleet, weights_index
from decentrl.weights.planner import plan

OFFLINE, SYNC, FETCH, LEASE, GENERATE, UPLOAD = range(6)
NO_WORK_WAIT_SECONDS = 2.0  # the worker's longest idle wait (worker/weights.py NO_WEIGHTS_MAX_SECONDS)
CHUNK_BYTES = 4 << 20
FULL_UPLOAD_CHUNKS = 8  # a downloader holding this many chunks uploads at its full rate


def usable_uplink(held_bytes: np.ndarray) -> np.ndarray:
    """Share of a downloader's uplink that peers can use: it can only serve the chunks it holds."""
    return np.minimum(1.0, held_bytes / (FULL_UPLOAD_CHUNKS * CHUNK_BYTES))


@dataclass
class Counts:
    """What the coordinator saw, by route, and what happened to the work."""

    requests: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Requests by route; chunk requests are counted in fractions of a chunk."""
    coordinator_bytes: float = 0.0
    peer_bytes: float = 0.0
    accepted_groups: int = 0
    rejected_stale_groups: int = 0
    expired_groups: int = 0
    lost_groups: int = 0
    trained_staleness: Counter = field(default_factory=Counter)
    trainer_idle_seconds: float = 0.0
    reach_90_seconds: list[float] = field(default_factory=list)
    generating_seconds: float = 0.0
    fetching_seconds: float = 0.0
    online_seconds: float = 0.0


class Simulation:
    def __init__(self, config: SwarmConfig, fleet: Fleet | None = None) -> None:
        self.config = config
        self.fleet = fleet or draw_fleet(config)
        n = config.num_workers
        self.rng = np.random.default_rng(config.seed + 1)
        self.now = 0.0
        self.latest = 0
        self.published_at = {0: 0.0}
        online_share = self.fleet.session_seconds / (self.fleet.session_seconds + self.fleet.absence_seconds)
        online = self.rng.random(n) < online_share
        self.phase = np.where(online, SYNC, OFFLINE)
        self.until = np.where(
            online,
            self.rng.exponential(self.fleet.session_seconds),
            self.rng.exponential(self.fleet.absence_seconds),
        )
        self.held = np.zeros(n, dtype=int)  # a warm run: everyone online holds version 0
        self.target = np.full(n, -1)
        self.remaining = np.zeros(n)  # tokens to generate, then bytes to upload
        self.fetching = np.zeros(n, dtype=bool)
        self.fetch_left = np.zeros(n)  # bytes of the route still to download
        self.route_bytes = np.ones(n)
        self.sampled = np.full(n, -1)  # version a generating worker samples with
        self.wait_until = np.zeros(n)
        self.untrained = 0  # groups leased or accepted but not trained (max_pending_groups)
        self.ready: Counter = Counter()  # accepted groups waiting for the trainer, by sampling version
        self.coordinator_sent: defaultdict[int, float] = defaultdict(
            float
        )  # bytes of each version sent by the coordinator
        self.training_until: float | None = None
        self.counts = Counts()
        self.routes: dict[tuple[int, int], int] = {}
        self.reached: set[int] = set()
        nominal_groups_per_second = self.fleet.tokens_per_second.mean() * online_share.mean() * n
        nominal_groups_per_second /= config.group_size * config.rollout_tokens
        self.lease_tokens = config.group_size * config.groups_per_lease * config.rollout_tokens
        self.batch_groups = max(1, int(nominal_groups_per_second * config.step_seconds))
        self.max_pending_groups = 2 * self.batch_groups + int(online.sum())

    # ------------------------------------------------------------------ planning

    def route_bytes_for(self, held: int, target: int) -> int:
        """Payload bytes of the planner's route (cached: workers holding the same version share it)."""
        key = (held, target)
        if key not in self.routes:
            index = weights_index(self.config, target)
            self.routes[key] = plan(None if held < 0 else held, target, index).num_bytes
        return self.routes[key]

    # ------------------------------------------------------------------ one tick

    def step(self) -> None:
        dt = self.config.tick_seconds
        self.churn()
        self.sync()
        self.fetch(dt)
        self.lease()
        self.generate(dt)
        self.upload(dt)
        self.train()
        self.record_reach()
        online = self.phase != OFFLINE
        self.counts.online_seconds += float(online.sum()) * dt
        self.counts.generating_seconds += float((self.phase == GENERATE).sum()) * dt
        self.counts.fetching_seconds += float((self.phase == FETCH).sum()) * dt
        self.now += dt

    def churn(self) -> None:
        leaving = (self.phase != OFFLINE) & (self.until <= self.now)
        # A group in flight is lost with its worker; its slots are leased again after the deadline.
        lost = int((leaving & np.isin(self.phase, (GENERATE, UPLOAD))).sum()) * self.config.groups_per_lease
        self.counts.lost_groups += lost
        self.untrained -= lost
        self.phase[leaving] = OFFLINE
        self.until[leaving] = self.now + self.rng.exponential(self.fleet.absence_seconds[leaving])
        joining = (self.phase == OFFLINE) & (self.until <= self.now) & ~leaving
        self.phase[joining] = SYNC
        # Some who come online are new (or lost their state directory): they hold nothing.
        fresh = joining & (self.rng.random(joining.size) < self.config.new_worker_fraction)
        self.held[fresh] = -1
        self.until[joining] = self.now + self.rng.exponential(self.fleet.session_seconds[joining])

    def sync(self) -> None:
        """GET /weights/latest; behind: plan a route (GET index, manifests) and start fetching.

        The worker loop fetches before it leases again (FETCH blocks it). With `background_fetch`
        it keeps leasing on the version it holds while that is within `max_staleness`, and only a
        worker too stale (or holding nothing) waits for its download."""
        asking = (self.phase == SYNC) & (self.wait_until <= self.now)
        self.counts.requests["weights_latest"] += int(asking.sum())
        start = np.flatnonzero(asking & (self.held != self.latest) & ~self.fetching)
        if start.size:
            self.counts.requests["weights_index"] += start.size
            self.counts.requests["peers"] += start.size * (2 if self.config.relay else 1)
            for held in np.unique(self.held[start]):
                who = start[self.held[start] == held]
                size = self.route_bytes_for(int(held), self.latest)
                self.fetch_left[who] = size
                self.route_bytes[who] = size
            self.target[start] = self.latest
            self.fetching[start] = True
        usable = (self.held >= 0) & (self.latest - self.held <= self.config.max_staleness)
        if self.config.background_fetch:
            self.phase[asking & usable] = LEASE
            self.phase[asking & ~usable] = FETCH
        else:
            self.phase[asking & (self.held == self.latest)] = LEASE
            self.phase[asking & (self.held != self.latest)] = FETCH

    def fetch(self, dt: float) -> None:
        who = np.flatnonzero(self.fetching & (self.phase != OFFLINE))
        if who.size == 0:
            return
        uplink = self.config.coordinator_uplink_gbit * 1000 * MBIT
        down = np.minimum(self.fleet.down[who], self.fetch_left[who] / dt)
        if self.config.relay:
            progress = usable_uplink(self.route_bytes[who] - self.fetch_left[who])
            serving = (self.phase != OFFLINE) & self.fleet.serves & ~self.fetching
            seeds = {
                int(v): float(self.fleet.up[serving & (self.held == v)].sum())
                for v in np.unique(self.target[who])
            }
            partial_up = np.where(self.fleet.serves[who], self.fleet.up[who], 0.0)
            rates, by_version = bandwidth.relay(down, self.target[who], progress, seeds, partial_up, uplink)
            for version, rate in by_version.items():
                self.coordinator_sent[version] += rate * dt
                # No one gets ahead of what the coordinator has sent of the route at least once.
                mask = self.target[who] == version
                fetched = self.route_bytes[who][mask] - self.fetch_left[who][mask]
                limit = np.maximum(self.coordinator_sent[version] - fetched, 0.0)
                rates[mask] = np.minimum(rates[mask], limit / dt)
            coordinator_bytes = sum(by_version.values()) * dt
        else:
            rates = bandwidth.coordinator_only(down, uplink)
            coordinator_bytes = float(rates.sum()) * dt
        moved = rates * dt
        self.counts.coordinator_bytes += coordinator_bytes
        self.counts.peer_bytes += max(0.0, float(moved.sum()) - coordinator_bytes)
        self.counts.requests["weights_chunk"] += coordinator_bytes / CHUNK_BYTES
        self.fetch_left[who] -= moved
        done = who[self.fetch_left[who] <= 1.0]
        self.held[done] = self.target[done]  # a generation in flight keeps its own version (`sampled`)
        self.fetching[done] = False
        waiting = done[self.phase[done] == FETCH]
        self.phase[waiting] = SYNC

    def lease(self) -> None:
        asking = np.flatnonzero((self.phase == LEASE) & (self.wait_until <= self.now))
        if asking.size == 0:
            return
        self.counts.requests["lease"] += asking.size
        # Too stale to lease (the latest moved on meanwhile): back to the version check.
        stale = asking[self.latest - self.held[asking] > self.config.max_staleness]
        self.phase[stale] = SYNC
        fresh = asking[self.latest - self.held[asking] <= self.config.max_staleness]
        room = max(0, self.max_pending_groups - self.untrained) // self.config.groups_per_lease
        self.rng.shuffle(fresh)
        granted, refused = fresh[:room], fresh[room:]
        self.untrained += granted.size * self.config.groups_per_lease
        self.sampled[granted] = self.held[granted]
        self.remaining[granted] = self.lease_tokens
        self.phase[granted] = GENERATE
        # 204 (nothing to do): the worker waits, then starts its loop again from the version check.
        self.wait_until[refused] = self.now + NO_WORK_WAIT_SECONDS
        self.phase[refused] = SYNC

    def generate(self, dt: float) -> None:
        who = np.flatnonzero(self.phase == GENERATE)
        self.remaining[who] -= self.fleet.tokens_per_second[who] * dt
        done = who[self.remaining[who] <= 0]
        size = self.lease_tokens * self.config.submit_bytes_per_token
        self.remaining[done] = size
        self.phase[done] = UPLOAD

    def upload(self, dt: float) -> None:
        who = np.flatnonzero(self.phase == UPLOAD)
        self.remaining[who] -= self.fleet.up[who] * dt
        done = who[self.remaining[who] <= 0]
        if done.size == 0:
            return
        self.counts.requests["submit"] += done.size
        accepted = done[self.latest - self.sampled[done] <= self.config.max_staleness]
        per_lease = self.config.groups_per_lease
        rejected = (done.size - accepted.size) * per_lease
        self.counts.rejected_stale_groups += rejected
        self.counts.accepted_groups += accepted.size * per_lease
        self.untrained -= rejected
        versions, numbers = np.unique(self.sampled[accepted], return_counts=True)
        for version, number in zip(versions.tolist(), numbers.tolist(), strict=True):
            self.ready[version] += number * per_lease
        self.phase[done] = SYNC

    def train(self) -> None:
        if self.training_until is not None and self.now >= self.training_until:
            self.latest += 1  # the update is published; workers see it at their next version check
            self.published_at[self.latest] = self.now
            self.training_until = None
        if self.training_until is not None:
            return
        oldest = self.latest - self.config.max_staleness
        for version in [v for v in self.ready if v < oldest]:
            # Too stale at batch time: expired and counted, as `batching.py` does to ready groups.
            expired = self.ready.pop(version)
            self.counts.expired_groups += expired
            self.untrained -= expired
        if sum(self.ready.values()) < self.batch_groups:
            self.counts.trainer_idle_seconds += self.config.tick_seconds
            return
        wanted = self.batch_groups
        for version in sorted(self.ready):  # the oldest groups first, as the coordinator batches them
            taken = min(wanted, self.ready[version])
            self.counts.trained_staleness[self.latest - version] += taken
            self.ready[version] -= taken
            wanted -= taken
            if not self.ready[version]:
                del self.ready[version]
            if not wanted:
                break
        self.untrained -= self.batch_groups
        self.training_until = self.now + self.config.step_seconds

    def record_reach(self) -> None:
        """Time from publication until 90 % of the online workers hold a version (or a newer one)."""
        online = self.phase != OFFLINE
        if not online.any():
            return
        for version in range(max(1, self.latest - 3), self.latest + 1):
            if version in self.reached:
                continue
            if (self.held[online] >= version).mean() >= 0.9:
                self.reached.add(version)
                self.counts.reach_90_seconds.append(self.now - self.published_at[version])

    def run(self) -> Counts:
        while self.now < self.config.duration_seconds:
            self.step()
        return self.counts
