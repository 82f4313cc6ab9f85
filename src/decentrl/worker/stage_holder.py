"""A stage holder's loop (`decentrl worker --stage S`, S >= 1): hold stage S, serve its steps.

It materialises only stage S (`model/stages.py`), follows the published versions of that stage
alone (`WorkerWeights` with a stage: only its chunks are fetched, only its tensors decoded and
verified by their stage hash), keeps the last `worker.stage_window` versions (`stage_versions.py`)
and serves drivers' steps (`stage_server.py`). It announces its address, the versions it holds and
its measured rate every `ANNOUNCE_SECONDS` and after each new version, so that the coordinator
routes leases through it. It takes no leases of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from decentrl.client import CoordinatorClient, RequestRejected
from decentrl.config import WorkerConfig
from decentrl.engines.registry import declared_precision
from decentrl.model.stages import load_stage
from decentrl.protocol import ServerInfo
from decentrl.stage_wire import StageAnnounce
from decentrl.worker.stage_relay_link import RelayLink
from decentrl.worker.stage_server import StageServer
from decentrl.worker.stage_versions import StageVersions
from decentrl.worker.weights import WorkerWeights

log = logging.getLogger(__name__)

ANNOUNCE_SECONDS = 2.0
MATERIALISED_FILE = "materialised.txt"
"""In the state directory: the parameter names this process allocated (`StageVersions.record`)."""
POLL_SECONDS = 0.5


def hold_stage(
    client: CoordinatorClient,
    config: WorkerConfig,
    info: ServerInfo,
    model_dir: Path,
    state_dir: Path,
    holder_id: str,
    stop: threading.Event,
) -> int:
    assert info.stage_map is not None and config.stage is not None and config.stage >= 1
    dtype, device = declared_precision(config)
    stage = load_stage(model_dir, info.stage_map, config.stage, dtype=dtype, device=device)
    versions = StageVersions(stage, window=config.stage_window, record=state_dir / MATERIALISED_FILE)
    weights = WorkerWeights(client, versions, config, state_dir, stage=config.stage)
    server = StageServer(
        versions, client, holder_id, host=config.peer_host, listen=config.stage_listen
    ).start()
    link = RelayLink(client, server, stop)
    log.info(
        "holding stage %d of %s (%d tensors) and serving its steps %s",
        config.stage,
        info.stage_map.describe(),
        len(stage.materialised),
        f"at {server.url}" if server.url else "through the coordinator's relay (worker.stage_listen = false)",
    )
    announced = 0.0
    try:
        while not stop.is_set():
            latest = client.latest_weights()
            if latest is not None and latest.version > versions.policy_version:
                loaded = weights.fetch(latest)
                if loaded is not None:
                    with server.compute:  # never in the middle of a step
                        weights.apply(loaded)
                    announced = 0.0  # routes to this version may go through it now
            if time.monotonic() - announced > ANNOUNCE_SECONDS and versions.policy_version >= 0:
                announce = StageAnnounce(
                    stage=config.stage,
                    url=server.url,
                    version=versions.policy_version,
                    held_versions=versions.held(),
                    tokens_per_second=round(server.tokens_per_second(), 1),
                )
                try:
                    answer = client.announce_stage(announce)
                except RequestRejected as exc:
                    log.error("the coordinator refuses this stage holder: %s", exc)
                    return 2
                if answer.relayed and not link.running:
                    if link.refused is not None:
                        return 2
                    log.info("drivers reach this holder through the coordinator's relay")
                    link.start()
                announced = time.monotonic()
            if client.run_complete:
                log.info("the run is complete (its trainer published its last version): exiting")
                break
            stop.wait(POLL_SECONDS)
    finally:
        server.close()
        weights.close()
    log.info(
        "stopped: served %d positions (%.0f/s of compute), %d requests through the relay",
        server.positions_served,
        server.tokens_per_second(),
        link.served,
    )
    return 0
