"""Shared by the weight tests: a real coordinator process, a tiny model, a publisher, a fault proxy."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import torch

from decentrl.client import CoordinatorClient
from decentrl.config import ModelConfig, RunConfig, WeightsConfig, WorkerConfig
from decentrl.weights.publisher import Publisher

COORDINATOR = (
    "import sys, pathlib; from decentrl.config import RunConfig; from decentrl.coordinator.server import serve; "
    "serve(RunConfig.model_validate_json(sys.argv[1]), pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3]))"
)
TINY = ModelConfig(hidden_size=64, num_heads=2, intermediate_size=64, num_layers=1)


class Coordinator:
    """`decentrl.coordinator.server.serve` in its own process on a free loopback port."""

    def __init__(self, tmp_path: Path, model_dir: Path, model: ModelConfig = TINY, **weights: object):
        self.run = RunConfig(model=model, weights=WeightsConfig(**weights))
        self.run.coordinator.port = 0
        self.run_dir = tmp_path / "run"
        self.log = tmp_path / "coordinator.log"
        with self.log.open("a") as file:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    COORDINATOR,
                    self.run.model_dump_json(),
                    str(self.run_dir),
                    str(model_dir),
                ],
                stdout=file,
                stderr=subprocess.STDOUT,
                env=os.environ | {"PYTHONUNBUFFERED": "1"},
            )
        announce = self.run_dir / "coordinator.json"
        deadline = time.monotonic() + 120
        while not announce.is_file():
            assert self.process.poll() is None and time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.05)
        self.endpoint = json.loads(announce.read_text())
        self.url = self.endpoint["url"]
        self.trainer = CoordinatorClient(self.url, self.endpoint["trainer_token"], max_wait=30)

    def worker_client(self, state_dir: Path, url: str | None = None, **options: object) -> CoordinatorClient:
        """A registered worker's client, through `url` (a proxy) when given."""
        from decentrl.worker.credentials import register

        client = CoordinatorClient(url or self.url, **options)
        config = WorkerConfig(
            coordinator_url=client.url, token=self.endpoint["enroll_token"], name=state_dir.name
        )
        register(client, config, state_dir)
        return client

    def stop(self) -> None:
        self.trainer.close()
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        finally:
            self.process.kill()


def tiny_model(model_dir: Path, config: ModelConfig = TINY) -> torch.nn.Module:
    from decentrl.model.tiny import build_tiny, save_model_dir

    model, tokenizer = build_tiny(config)
    save_model_dir(model, tokenizer, model_dir)
    return model


def perturb(model: torch.nn.Module, fraction: float, seed: int, only: str = "") -> None:
    """Move `fraction` of the elements of every parameter whose name contains `only` by far more
    than a bf16 step."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if only not in name:
                continue
            mask = torch.rand(parameter.shape, generator=generator) < fraction
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator) * mask)


def publish_versions(
    publisher: Publisher, model: torch.nn.Module, versions: range, fraction: float, only: str = ""
) -> None:
    for version in versions:
        if version > 0:
            perturb(model, fraction, seed=version, only=only)
        publisher.publish(model, version)


class FaultProxy:
    """An HTTP reverse proxy to the coordinator; `rules` may rewrite or cut any answer."""

    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self.requests: Counter[str] = Counter()
        self.rules: list[Callable[[str, bytes], bytes | None]] = []
        """Called with (path, body); return new body bytes, or None to cut the answer in half."""
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")
                }
                proxy.requests[self.path] += 1
                answer = httpx.request(
                    self.command, proxy.upstream + self.path, content=body, headers=headers
                )
                content = answer.content
                for rule in list(proxy.rules):
                    changed = rule(self.path, content)
                    if changed is None:  # truncate: promise everything, send half, hang up
                        self.send_response(answer.status_code)
                        self.send_header("Content-Length", str(len(content)))
                        self.end_headers()
                        self.wfile.write(content[: len(content) // 2])
                        self.close_connection = True
                        return
                    content = changed
                self.send_response(answer.status_code)
                self.send_header(
                    "Content-Type", answer.headers.get("content-type", "application/octet-stream")
                )
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            do_GET = do_POST = do_PUT = _forward

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def chunk_requests(self) -> Counter[str]:
        return Counter({p: n for p, n in self.requests.items() if "/weights/chunks/" in p})

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
