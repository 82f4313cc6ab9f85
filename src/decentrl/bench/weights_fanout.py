"""Fan-out of one new version to N workers: coordinator alone vs. with peer relay.

Real sockets on loopback, real code: a coordinator process whose chunk uploads share one token
bucket (`weights.upload_bytes_per_second`, the bottleneck), and N workers in this process, each
with its own client, chunk store and `WeightSync`. With relay, every worker also runs its
`PeerServer` with the same upload cap as the coordinator (symmetric links) and fetches each chunk
from up to `max_peer_attempts` random peers before the coordinator (weights/transfer.py).
The time is from the moment all workers start until the last one holds the verified version.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from decentrl.client import CoordinatorClient
from decentrl.config import ModelConfig, RunConfig, WeightsConfig, WorkerConfig
from decentrl.protocol import PeerAnnounce
from decentrl.weights.chunks import ChunkStore
from decentrl.weights.peer import PeerServer
from decentrl.weights.publisher import Publisher
from decentrl.weights.signing import parse_public_key
from decentrl.weights.sync import WeightSync
from decentrl.weights.transfer import ChunkFetcher

log = logging.getLogger(__name__)

SERVE = (
    "import sys, pathlib, logging; logging.disable(logging.INFO); from decentrl.config import RunConfig; "
    "from decentrl.coordinator.server import serve; "
    "serve(RunConfig.model_validate_json(sys.argv[1]), pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3]))"
)


def start_coordinator(root: Path, weights: WeightsConfig, num_workers: int) -> tuple[subprocess.Popen, dict]:
    from decentrl.model.tiny import build_tiny, save_model_dir

    model_dir = save_model_dir(
        *build_tiny(ModelConfig(hidden_size=32, num_heads=1, intermediate_size=32)), root / "model"
    )
    run = RunConfig(weights=weights)
    run.coordinator.port = 0
    run.trust.requests_per_second = max(run.trust.requests_per_second, 1000.0)  # many chunk GETs per worker
    run.trust.request_burst = max(run.trust.request_burst, 1000)
    process = subprocess.Popen(
        [sys.executable, "-c", SERVE, run.model_dump_json(), str(root / "run"), str(model_dir)],
        stdout=subprocess.DEVNULL,
        stderr=open(root / "coordinator.log", "ab"),  # noqa: SIM115 - lives as long as the process
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    announce = root / "run" / "coordinator.json"
    deadline = time.monotonic() + 120
    while not announce.is_file():
        assert process.poll() is None and time.monotonic() < deadline, (root / "coordinator.log").read_text()
        time.sleep(0.05)
    return process, json.loads(announce.read_text())


def synthetic_state(num_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Normal weights (std 0.02) in fp32, published as bf16: about `num_bytes` of bf16."""
    generator = torch.Generator().manual_seed(seed)
    rows = max(1, num_bytes // 2 // 1024 // 4)
    return {f"layer{i}.weight": torch.randn(rows, 1024, generator=generator) * 0.02 for i in range(4)}


class SimulatedWorker:
    def __init__(self, root: Path, endpoint: dict, public_key: str, relay: bool, upload: float, index: int):
        from decentrl.worker.credentials import register

        self.client = CoordinatorClient(endpoint["url"], max_wait=120)
        config = WorkerConfig(
            coordinator_url=endpoint["url"], token=endpoint["enroll_token"], name=f"sim-{index}"
        )
        register(self.client, config, root)
        store = ChunkStore(root / "chunks", durable=False)
        self.fetcher = ChunkFetcher(self.client, store, seed=index, max_peer_attempts=3)
        self.sync = WeightSync(self.client, parse_public_key(public_key), self.fetcher)
        self.server = PeerServer(store, bytes_per_second=upload).start() if relay else None
        self.seconds = float("nan")

    def announce(self) -> None:
        if self.server is not None:
            self.client.announce_peer(PeerAnnounce(url=self.server.url, version=-1))

    def run(self, start: threading.Event, started_at: list[float]) -> None:
        if self.server is not None:
            self.fetcher.peers = self.client.peers()
        start.wait()
        self.sync.sync_to(0)
        self.seconds = time.perf_counter() - started_at[0]

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.fetcher.close()
        self.client.close()


def fan_out(
    root: Path, endpoint: dict, public_key: str, num_workers: int, relay: bool, upload: float
) -> dict:
    workers = [
        SimulatedWorker(root / f"{'relay' if relay else 'alone'}-{i}", endpoint, public_key, relay, upload, i)
        for i in range(num_workers)
    ]
    for worker in workers:
        worker.announce()
    start, started_at = threading.Event(), [0.0]
    threads = [threading.Thread(target=w.run, args=(start, started_at), daemon=True) for w in workers]
    for thread in threads:
        thread.start()
    time.sleep(0.5)  # every worker has its peer list
    started_at[0] = time.perf_counter()
    start.set()
    for thread in threads:
        thread.join(600)
    seconds = [w.seconds for w in workers]
    hashes = {w.sync.state_sha256 for w in workers}
    from_coordinator = sum(w.fetcher.bytes_from["coordinator"] for w in workers)
    total = sum(sum(w.fetcher.bytes_from.values()) for w in workers)
    for worker in workers:
        worker.close()
    assert len(hashes) == 1 and None not in hashes, "a worker did not reach the verified version"
    return {
        "seconds": max(seconds),
        "median_worker_seconds": sorted(seconds)[len(seconds) // 2],
        "coordinator_bytes": from_coordinator,
        "peer_bytes": total - from_coordinator,
    }


def measure_fanout(
    root: Path, num_workers: int = 32, payload_mb: float = 4.0, upload_mb_s: float = 8.0, chunk_kb: int = 128
) -> dict:
    """Seconds for `num_workers` to reach a new version from the coordinator alone and with relay."""
    upload = upload_mb_s * 1e6
    weights = WeightsConfig(chunk_bytes=chunk_kb * 1024, upload_bytes_per_second=upload)
    process, endpoint = start_coordinator(root, weights, num_workers)
    try:
        trainer = CoordinatorClient(endpoint["url"], endpoint["trainer_token"], max_wait=60)
        publisher = Publisher(trainer, weights, root / "trainer-key.pem")
        publisher.register()
        (published,) = publisher.publish_state(synthetic_state(int(payload_mb * 1e6)), 0)
        print(
            f"fan-out: v0 payload {published.payload_bytes / 1e6:.2f} MB to {num_workers} workers",
            file=sys.stderr,
        )
        alone = fan_out(root, endpoint, publisher.public_key, num_workers, relay=False, upload=upload)
        print(f"fan-out: coordinator alone {alone['seconds']:.1f} s", file=sys.stderr)
        relay = fan_out(root, endpoint, publisher.public_key, num_workers, relay=True, upload=upload)
        print(f"fan-out: with peer relay {relay['seconds']:.1f} s", file=sys.stderr)
        trainer.close()
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
    return {
        "fanout_speedup": alone["seconds"] / relay["seconds"],
        "fanout_workers": num_workers,
        "fanout_payload_bytes": published.payload_bytes,
        "fanout_upload_mb_s": upload_mb_s,
        "fanout_chunk_bytes": chunk_kb * 1024,
        "fanout_coordinator_only": alone,
        "fanout_peer_relay": relay,
    }
