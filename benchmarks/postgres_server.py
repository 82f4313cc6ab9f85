"""A throwaway PostgreSQL server for tests and benchmarks: initdb into a temp dir, pg_ctl start/stop.

Debian's `postgresql` package puts `initdb` and `pg_ctl` under /usr/lib/postgresql/<major>/bin
(the Makefile installs it with apt). PostgreSQL refuses to run as root, so as root (CI) both run as
the `postgres` user through `runuser`, in a directory that user owns. The server listens on
127.0.0.1 at a free port and trusts local connections: it lives as long as one test session.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from decentrl.pgsql import PostgresUnavailable


def binaries() -> Path:
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), reverse=True)
    if not candidates:
        raise PostgresUnavailable(
            "PostgreSQL is not installed: run 'sudo apt-get install -y postgresql' (or `make postgres`)"
        )
    return Path(candidates[0]).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PostgresServer:
    """`with PostgresServer() as server: server.url` -> postgresql://postgres@127.0.0.1:PORT/postgres"""

    def __init__(self) -> None:
        self.bin = binaries()
        self.root = Path(tempfile.mkdtemp(prefix="decentrl-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.as_root = os.geteuid() == 0
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *command: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if self.as_root else []
        finished = subprocess.run([*prefix, *command], capture_output=True, text=True, timeout=120)
        if finished.returncode != 0:
            raise PostgresUnavailable(f"{' '.join(command[:2])} failed: {finished.stderr.strip()[-800:]}")

    def start(self) -> PostgresServer:
        if self.as_root:
            shutil.chown(self.root, "postgres", "postgres")
        user = "postgres"
        self._run(
            str(self.bin / "initdb"),
            "-D",
            str(self.data),
            "-U",
            user,
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-sync",
        )
        # fsync stays on: the coordinator's 2xx-means-durable rule is measured with real commits.
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c max_connections=200"
        self._run(
            str(self.bin / "pg_ctl"),
            "-D",
            str(self.data),
            "-o",
            options,
            "-l",
            str(self.root / "server.log"),
            "-w",
            "-t",
            "60",
            "start",
        )
        return self

    def stop(self) -> None:
        with contextlib.suppress(PostgresUnavailable):  # already stopped
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
