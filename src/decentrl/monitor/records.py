"""What the coordinator records for the dashboard beyond the run's own state: the trainer's
log-probs of a few trained rollouts (`StepMetrics.rollout_logprobs`) and how each worker's weight
updates arrived (`LeaseRequest.weights_received`, self-reported). Written in the coordinator's
transactions (tables in coordinator/db/schema.py, migration 2), read by monitor/dashboard_data.py
and monitor/inspector.py.
"""

from __future__ import annotations

import json

from decentrl.dbapi import Connection
from decentrl.protocol import RolloutLogprobs, WeightsReceived


def store_rollout_logprobs(db: Connection, version: int, items: list[RolloutLogprobs]) -> None:
    """`version` is the one the trainer computed them with (the policy before its update)."""
    db.executemany(
        "INSERT OR REPLACE INTO trainer_logprobs (rollout_id, version, logprobs) VALUES (?, ?, ?)",
        [(item.rollout_id, version, json.dumps(item.logprobs)) for item in items],
    )


def store_weights_received(db: Connection, worker_id: str, received: WeightsReceived) -> None:
    db.execute(
        "INSERT OR REPLACE INTO weight_traffic (version, worker_id, coordinator_bytes, peer_bytes) "
        "VALUES (?, ?, ?, ?)",
        (received.version, worker_id, received.coordinator_bytes, received.peer_bytes),
    )
