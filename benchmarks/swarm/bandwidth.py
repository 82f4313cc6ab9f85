"""The fluid bandwidth model of `decentrl bench swarm`: who downloads how fast in one tick.

10,000 workers times thousands of 4 MiB chunks is too many events for a per-chunk simulation in
minutes, so bytes flow as a fluid, re-shared every tick. A pool of upload capacity (the
coordinator's uplink, plus in relay mode the uplinks of the peers that hold what is asked) is
divided max-min fairly among the downloaders, none above its own download rate. That is the
steady state of many TCP flows through one bottleneck, and the usual fluid model of BitTorrent-like
swarms (Qiu and Srikant, SIGCOMM 2004). Two limits of the real protocol are kept: a relay peer
serves only what it holds (a partial download serves in proportion to its progress), and in
relay mode no downloader gets ahead of what the coordinator has sent of that version at least once.
"""

from __future__ import annotations

import numpy as np


def max_min_share(demand: np.ndarray, supply: float) -> np.ndarray:
    """Rates r <= demand with sum(r) = min(supply, sum(demand)), the smallest demands met first."""
    if demand.size == 0 or supply <= 0:
        return np.zeros_like(demand)
    if demand.sum() <= supply:
        return demand.copy()
    order = np.sort(demand)
    # After meeting the k smallest demands in full, the rest share what is left equally.
    met = np.concatenate(([0.0], np.cumsum(order)[:-1]))
    remaining = np.arange(demand.size, 0, -1)
    level = (supply - met) / remaining
    k = int(np.searchsorted(order >= level, True))  # first demand that the equal share does not meet
    return np.minimum(demand, level[k])


def coordinator_only(down: np.ndarray, uplink: float) -> np.ndarray:
    """Every downloader shares the coordinator's uplink."""
    return max_min_share(down, uplink)


def relay(
    down: np.ndarray,
    targets: np.ndarray,
    progress: np.ndarray,
    seed_up_by_target: dict[int, float],
    partial_up: np.ndarray,
    uplink: float,
) -> tuple[np.ndarray, dict[int, float]]:
    """Rates of downloaders with peer relay, and the coordinator's bytes/s per target version.

    `targets`: the version each downloader is fetching; `progress`: how much of its own uplink it can
    use (a downloader holding a few chunks others lack uploads at full rate: BitTorrent's efficiency
    is close to 1 with many chunks, Qiu and Srikant);
    `seed_up_by_target`: summed uplink of serving peers that hold each version;
    `partial_up`: each downloader's own uplink if it serves peers, else 0.
    """
    rates = np.zeros_like(down)
    coordinator_rates: dict[int, float] = {}
    demand_by_target = {int(v): float(down[targets == v].sum()) for v in np.unique(targets)}
    total_demand = sum(demand_by_target.values()) or 1.0
    for version, demand in demand_by_target.items():
        mask = targets == version
        coordinator_share = uplink * demand / total_demand
        peers = seed_up_by_target.get(version, 0.0) + float((partial_up[mask] * progress[mask]).sum())
        share = max_min_share(down[mask], coordinator_share + peers)
        rates[mask] = share
        total = float(share.sum())
        # The coordinator answers the part peers could not: its share, less what peers carried.
        coordinator_rates[version] = min(coordinator_share, total)
    return rates, coordinator_rates
