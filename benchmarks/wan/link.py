"""An internet access link on loopback: the pipeline bench's delay proxy plus a bandwidth cap, lost
connections and stalls.

`WanLink` relays one worker's TCP connections (to the coordinator, or from peers to its chunk
server) as `DelayProxy` does, adding a round trip with jitter to every exchange, and also:

- **bandwidth**: a token bucket per direction, shared by every connection of the link (one access
  link), `bandwidth_bytes_per_s` with a burst of `burst_bytes`: a chunk leaves once the bucket
  holds its bytes, so a large body takes size / rate, and chunks queue behind each other (what the
  kernel's `tbf` qdisc does; this kernel has no `netem`, and `tbf` would need a network namespace
  per worker);
- **drops**: each chunk (a request or an answer, or a 64 KiB piece of a large one) breaks its
  connection with probability `drop_rate`: both ends see a reset, as when a NAT box forgets a
  mapping or a Wi-Fi link drops;
- **stalls**: each chunk is held `stall_s` longer with probability `stall_rate` (a congested hop).

Every draw comes from the link's seeded generator, so a link replays its losses. `Traffic` counts
the bytes each way, connections, drops and stalls.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.pipeline.delay_proxy import DelayProxy

DEFAULT_BURST_BYTES = 16_384


@dataclass(frozen=True)
class LinkSpec:
    """One access link's behaviour."""

    rtt_s: float = 0.0
    jitter_s: float = 0.0
    """Each one-way delay is rtt_s / 2 plus a uniform draw in +-jitter_s."""
    bandwidth_bytes_per_s: float | None = None
    """Per direction; None: uncapped."""
    drop_rate: float = 0.0
    stall_rate: float = 0.0
    stall_s: float = 2.0
    burst_bytes: int = DEFAULT_BURST_BYTES


@dataclass
class Bucket:
    tokens: float
    time: float


class WanLink(DelayProxy):
    def __init__(self, upstream_host: str, upstream_port: int, spec: LinkSpec, seed: int = 0) -> None:
        super().__init__(upstream_host, upstream_port, spec.rtt_s, spec.jitter_s, seed)
        assert spec.bandwidth_bytes_per_s is None or spec.bandwidth_bytes_per_s > 0
        assert 0.0 <= spec.drop_rate < 1.0 and 0.0 <= spec.stall_rate < 1.0
        self.spec = spec
        self.buckets = {"up": Bucket(spec.burst_bytes, 0.0), "down": Bucket(spec.burst_bytes, 0.0)}
        self.drops = 0
        self.stalls = 0

    def transmitted(self, direction: str, size: int, now: float) -> float:
        """When a chunk of `size` bytes offered at `now` has left through the token bucket."""
        rate = self.spec.bandwidth_bytes_per_s
        if rate is None or size == 0:
            return now
        bucket = self.buckets[direction]
        start = max(now, bucket.time)  # behind the chunks already queued on this link
        tokens = min(float(self.spec.burst_bytes), bucket.tokens + (start - bucket.time) * rate)
        if tokens >= size:
            bucket.tokens, bucket.time = tokens - size, start
            return start
        left = start + (size - tokens) / rate
        bucket.tokens, bucket.time = 0.0, left
        return left

    def due(self, direction: str, size: int, now: float, not_before: float, last_due: float) -> float | None:
        if size and self.random.random() < self.spec.drop_rate:
            self.drops += 1
            return None
        sent = self.transmitted(direction, size, max(now, not_before))
        due = max(last_due, sent + self.one_way_delay())
        if size and self.random.random() < self.spec.stall_rate:
            self.stalls += 1
            due += self.spec.stall_s
        return due
