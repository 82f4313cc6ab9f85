"""The swarm simulation's parts against hand-computed values, and a small fleet end to end."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.swarm.bandwidth import max_min_share, relay
from benchmarks.swarm.fleet import SNAPSHOT_RATIO, Links, SwarmConfig, Training, weights_index
from benchmarks.swarm.main import broadcast_seconds
from benchmarks.swarm.simulation import Simulation
from decentrl.weights.planner import plan


def test_max_min_share_meets_small_demands_first() -> None:
    demand = np.array([1.0, 2.0, 10.0, 10.0])
    assert max_min_share(demand, 13.0).tolist() == [1.0, 2.0, 5.0, 5.0]
    assert max_min_share(demand, 3.0).tolist() == [0.75, 0.75, 0.75, 0.75]
    assert max_min_share(demand, 100.0).tolist() == demand.tolist()
    assert max_min_share(demand, 0.0).tolist() == [0.0] * 4


def test_relay_adds_seed_uplinks_to_the_coordinator_share() -> None:
    down = np.array([4.0, 4.0, 4.0])
    targets = np.array([1, 1, 2])
    # Version 1: coordinator share 3 * 8/12 = 2, plus seeds 4 -> 6 over two downloaders of 4 each.
    rates, coordinator = relay(down, targets, np.zeros(3), {1: 4.0}, np.zeros(3), uplink=3.0)
    assert rates.tolist() == [3.0, 3.0, 1.0]
    assert coordinator == {1: 2.0, 2: 1.0}


def test_the_real_planner_takes_the_simulated_index() -> None:
    config = SwarmConfig(params_billion=1.0, training=Training.lora)  # 2e9 bytes of bf16 state
    index = weights_index(config, 30)
    assert plan(29, 30, index).num_bytes == int(0.0081 * 2e9)  # one delta
    assert plan(21, 30, index).num_bytes == int(0.0185 * 2e9)  # one patch against snapshot v20
    from_nothing = plan(None, 30, index)
    assert from_nothing.num_bytes == int(SNAPSHOT_RATIO * 2e9) + int(0.0185 * 2e9)  # snapshot v20 + patch
    full = weights_index(config.model_copy(update={"training": Training.full}), 30)
    assert plan(25, 30, full).num_bytes == 5 * int(0.021 * 2e9)  # no patches: five deltas


@pytest.mark.parametrize("relay_on", [False, True])
def test_a_small_fleet_trains_within_the_staleness_bound_and_loses_nothing(relay_on: bool) -> None:
    config = SwarmConfig(num_workers=300, params_billion=0.5, relay=relay_on, duration_seconds=600)
    simulation = Simulation(config)
    counts = simulation.run()
    assert simulation.latest >= 3
    assert max(counts.trained_staleness) <= config.max_staleness
    trained = sum(counts.trained_staleness.values())
    # Every accepted group is trained, waiting, or expired (counted), never silently gone.
    assert counts.accepted_groups == trained + sum(simulation.ready.values()) + counts.expired_groups
    assert counts.reach_90_seconds, "new versions reach 90 % of the fleet"


def test_relay_spreads_a_snapshot_faster_than_the_coordinator_alone() -> None:
    config = SwarmConfig(num_workers=2000, params_billion=7.0, links=Links.datacenter)
    alone = broadcast_seconds(config, 10e9, relay=False)
    relayed = broadcast_seconds(config, 10e9, relay=True)
    online = 1000  # about half of the fleet; the coordinator alone sends 0.9 of them the payload
    assert alone > 0.5 * 0.9 * online * 10e9 / (10e9 / 8)
    assert relayed < alone / 10
