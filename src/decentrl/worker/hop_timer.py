"""A driver's clock on its route: how long each holder made it wait per decode step.

The driver times every decode step's request to each hop of its lease's route (send to answer,
through the relay for a relayed hop) and sends, with its next lease request, one `HopTiming` per
hop of each lease it generated: the median over the lease's decode steps and how many there were.
The coordinator keeps a smoothed figure per (driver, holder) and prefers, among equally loaded
holders, the one nearest this driver (`coordinator/route_latency.py`). With K stages every token
costs K round trips, so on a WAN the nearest holders are what keeps a decode step short.

Only decode steps are timed: the prefill carries the whole prompt and is paid once per
generation, while a decode step's round trip is paid once per token.
"""

from __future__ import annotations

import statistics

from decentrl.protocol import MAX_HOP_TIMINGS, MAX_STEP_MS, HopTiming, RouteHop


class HopTimer:
    def __init__(self) -> None:
        self.waits_ms: dict[tuple[str, int, str], list[float]] = {}
        """(lease, stage, holder) -> each decode step's round trip in ms, in order; kept until
        `take` (one lease's steps: at most its tokens times its generations)."""

    def record(self, lease_id: str, hop: RouteHop, seconds: float) -> None:
        self.waits_ms.setdefault((lease_id, hop.stage, hop.worker_id), []).append(seconds * 1000.0)

    def take(self) -> list[HopTiming]:
        """One timing per hop timed since the last call (the newest `MAX_HOP_TIMINGS`); forgets them.
        A lease whose hop failed is reported too: the steps that did come back were waited for."""
        waits, self.waits_ms = self.waits_ms, {}
        timings = [
            HopTiming(
                lease_id=lease_id,
                stage=stage,
                worker_id=holder,
                steps=min(len(ms), 1 << 20),
                step_ms=round(min(statistics.median(ms), MAX_STEP_MS), 3),
            )
            for (lease_id, stage, holder), ms in waits.items()
        ]
        return timings[-MAX_HOP_TIMINGS:]
