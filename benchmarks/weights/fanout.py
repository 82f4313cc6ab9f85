"""Fan-out of one new version to N workers: coordinator alone vs. with peer relay.

Real sockets on loopback, real code: a coordinator process whose chunk uploads share one token
bucket (`weights.upload_bytes_per_second`, the bottleneck), and N worker processes
(`fanout_worker.py`), each with its own key, client and chunk store. With relay, every worker also
runs its `PeerServer` with the same upload cap as the coordinator (symmetric links) and fetches
chunks that peers' have-lists offer before asking the coordinator (weights/transfer.py). The time
runs from the moment all workers are released until the last one holds every verified chunk of the
signed version (decoding is local and the same either way: see `decode_mb_s`).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.weights.fanout_worker import worker_main
from decentrl.client import CoordinatorClient
from decentrl.config import LOOPBACK_NETWORKS, ModelConfig, RunConfig, WeightsConfig
from decentrl.weights.publisher import Publisher

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


def fan_out(
    root: Path, endpoint: dict, public_key: str, num_workers: int, relay: bool, upload: float
) -> dict:
    """Start `num_workers` worker processes, release them at once, time until the last holds v0."""
    context = multiprocessing.get_context("spawn")
    ready, results = context.Queue(), context.Queue()
    start, stop = context.Event(), context.Event()
    processes = []
    for index in range(num_workers):
        settings = {
            "root": str(root / f"{'relay' if relay else 'alone'}-{index}"),
            "url": endpoint["url"],
            "enroll_token": endpoint["enroll_token"],
            "public_key": public_key,
            "relay": relay,
            "upload": upload,
            "index": index,
        }
        process = context.Process(
            target=worker_main, args=(settings, ready, start, stop, results), daemon=True
        )
        process.start()
        processes.append(process)
    for _ in processes:
        ready.get(timeout=300)  # registered (and announced): the clock starts with every worker set
    started = time.time()
    start.set()
    reports = [results.get(timeout=600) for _ in processes]
    stop.set()
    for process in processes:
        process.join(30)
    seconds = sorted(report["finished"] - started for report in reports)
    return {
        "seconds": seconds[-1],
        "median_worker_seconds": seconds[len(seconds) // 2],
        "coordinator_bytes": sum(report["coordinator_bytes"] for report in reports),
        "peer_bytes": sum(report["peer_bytes"] for report in reports),
    }


def measure_fanout(
    root: Path, num_workers: int = 32, payload_mb: float = 4.0, upload_mb_s: float = 8.0, chunk_kb: int = 128
) -> dict:
    """Seconds for `num_workers` to reach a new version from the coordinator alone and with relay."""
    upload = upload_mb_s * 1e6
    weights = WeightsConfig(
        chunk_bytes=chunk_kb * 1024, upload_bytes_per_second=upload, peer_networks=LOOPBACK_NETWORKS
    )
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
