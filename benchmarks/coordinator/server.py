"""The coordinator(s) under test of `decentrl bench coordinator`: started, published to, measured.

Each coordinator is its own `decentrl coordinator`-equivalent process (the real `serve`), so its CPU
time can be read from /proc and profiled. Version 0 is published by the real `Publisher` (a 4 MiB
synthetic state, one chunk), so version checks, leases and chunk downloads see a real run. The
trust budgets are raised for the load generator's address (every simulated worker comes from
127.0.0.1); everything else is the default configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from decentrl.client import CoordinatorClient
from decentrl.config import (
    LOOPBACK_NETWORKS,
    CoordinatorConfig,
    ModelConfig,
    RunConfig,
    TrustConfig,
    WeightsConfig,
)
from decentrl.launch.fork import RoleFailed

SERVE = (
    "import sys, pathlib, logging; logging.disable(logging.WARNING); from decentrl.config import RunConfig; "
    "from decentrl.coordinator.server import serve; "
    "serve(RunConfig.model_validate_json(sys.argv[1]), pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3]))"
)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PROMPT_ROOM = 64
"""Context positions left for the prompt beside the rollout (the arithmetic prompts take 4-8)."""


@dataclass
class Coordinator:
    process: subprocess.Popen
    endpoint: dict
    run_dir: Path
    store: str = "sqlite"

    @property
    def pid(self) -> int:
        return self.process.pid

    def cpu_seconds(self) -> float:
        """User + system CPU time of the process so far (/proc/PID/stat, fields 14 and 15)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS

    def store_size(self, store: str) -> dict:
        """Bytes of the store (SQLite: the file and its WAL; PostgreSQL: the database) per rollout."""
        if store == "sqlite":
            import sqlite3

            files = [self.run_dir / name for name in ("coordinator.db", "coordinator.db-wal")]
            size = sum(path.stat().st_size for path in files if path.is_file())
            with sqlite3.connect(self.run_dir / "coordinator.db") as db:
                rollouts = db.execute("SELECT COUNT(*) FROM rollouts").fetchone()[0]
        else:
            import psycopg

            with psycopg.connect(store) as db:
                size_row = db.execute("SELECT pg_database_size(current_database())").fetchone()
                count_row = db.execute("SELECT COUNT(*) FROM rollouts").fetchone()
                assert size_row is not None and count_row is not None  # aggregates always return a row
                size, rollouts = size_row[0], count_row[0]
        return {
            "store_bytes": size,
            "rollouts_stored": rollouts,
            "store_bytes_per_rollout": round(size / max(rollouts, 1)),
        }

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def run_config(args: argparse.Namespace, tokens: int, store: str) -> RunConfig:
    coordinator = CoordinatorConfig(
        port=0,
        store=store,
        group_size=args.group_size,
        max_new_tokens=tokens,
        max_pending_groups=4 * args.workers,
        max_body_bytes=max(4_000_000, 64 * args.group_size * tokens),
    )
    # One address sends every simulated worker's registration and requests; verification would hold
    # groups back for a verifier this bench does not run.
    trust = TrustConfig(
        verify_fraction=0.0,
        registrations_per_address_per_hour=1_000_000,
        requests_per_second=1000.0,
        request_burst=1000,
    )
    # The simulated workers serve chunks on loopback.
    return RunConfig(
        coordinator=coordinator, trust=trust, weights=WeightsConfig(peer_networks=LOOPBACK_NETWORKS)
    )


def launch(run: RunConfig, run_dir: Path, model_dir: Path, log: Path) -> Coordinator:
    run_dir.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        [sys.executable, "-c", SERVE, run.model_dump_json(), str(run_dir), str(model_dir)],
        stdout=subprocess.DEVNULL,
        stderr=open(log, "ab"),  # noqa: SIM115 - lives as long as the process
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    announce = run_dir / "coordinator.json"
    deadline = time.monotonic() + 120
    # Replicas share the run directory: wait for this process's own announcement.
    while not announce.is_file() or json.loads(announce.read_text() or "{}").get("pid") != process.pid:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait()
            # The log's last line is the coordinator's own one-line reason (a ConfigError, ...).
            lines = log.read_text(errors="replace").strip().splitlines() or ["(no output)"]
            raise RoleFailed(f"the bench's coordinator did not start: {lines[-1]}")
        time.sleep(0.05)
    return Coordinator(process, json.loads(announce.read_text()), run_dir)


def store_for(args: argparse.Namespace, root: Path) -> str:
    """ "sqlite", or a fresh database per run: on `--store`'s server, or ("postgresql") on a throwaway
    local server that lives as long as the bench."""
    if args.store == "sqlite":
        return "sqlite"
    import psycopg
    from psycopg import sql

    from benchmarks.postgres_server import PostgresServer

    if args.store == "postgresql":
        if getattr(args, "postgres_server", None) is None:
            args.postgres_server = PostgresServer().start()
        server_url = args.postgres_server.url
    else:
        server_url = args.store
    name = f"bench_{root.name.lower()}_{os.getpid()}"
    with psycopg.connect(server_url, autocommit=True) as connection:
        connection.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        connection.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return server_url.rsplit("/", 1)[0] + f"/{name}"


def start_coordinators(
    root: Path, args: argparse.Namespace, tokens: int
) -> tuple[list[Coordinator], dict, str]:
    """Start the coordinator(s), publish version 0; (coordinators, model info, the chunk's sha256)."""
    from benchmarks.weights.fanout import synthetic_state
    from decentrl.model.tiny import build_tiny, save_model_dir
    from decentrl.weights.publisher import Publisher

    root.mkdir(parents=True, exist_ok=True)
    # The coordinator refuses a token budget that no prompt fits in the model's context, so the
    # tiny model is built long enough for the rollouts measured (plus the task's short prompts).
    context = max(ModelConfig().max_positions, tokens + PROMPT_ROOM)
    model_dir = save_model_dir(*build_tiny(ModelConfig(max_positions=context)), root / "model")
    run = run_config(args, tokens, store_for(args, root))
    coordinators: list[Coordinator] = []
    try:  # a failure half-way must not leave the started processes running
        for i in range(args.replicas):
            coordinators.append(launch(run, root / "run", model_dir, root / f"coordinator-{i}.log"))
            coordinators[-1].store = run.coordinator.store
        endpoint = coordinators[0].endpoint
        with CoordinatorClient(endpoint["url"], endpoint["trainer_token"], max_wait=60) as trainer:
            publisher = Publisher(trainer, run.weights, root / "trainer-key.pem")
            publisher.register()
            (published,) = publisher.publish_state(synthetic_state(4 << 20), 0)
            info = trainer.info()
            manifest = json.loads(trainer.manifest_bytes(0, "snapshot"))
    except BaseException:
        for coordinator in coordinators:
            coordinator.stop()
        raise
    model = {"vocab_size": info.vocab_size, "eos_token_id": info.eos_token_ids[0]}
    return coordinators, model, manifest["chunks"][0]["sha256"]
