"""`[envd]`: the env servers that run served environments (`decentrl envd`, docs/environments.md).
Imports no torch."""

from __future__ import annotations

from pydantic import Field

from decentrl.config.base import Section


class EnvdConfig(Section):
    """One env server: a pool of instances of the run's environment, each a child process that
    holds live episodes (a browser with a tab per episode), behind an HTTP API for workers."""

    name: str = Field(default="envd", pattern=r"^[A-Za-z0-9_.\-]+$", max_length=64)
    """The server's id in the run (distinct per server; the local and Ray launchers number them)."""
    host: str = "127.0.0.1"
    """Address the server binds to."""
    port: int = Field(default=0, ge=0, le=65535)
    """TCP port (0 picks a free one)."""
    url: str | None = None
    """Where workers reach it, `http://HOST:PORT`; default http://host:port."""
    instances: int = Field(default=2, ge=1, le=1024)
    """Instances in the pool (child processes; a browser environment starts one browser each)."""
    sessions_per_instance: int = Field(default=16, ge=1, le=4096)
    """Episodes one instance holds at once (a browser's tabs)."""
    step_seconds: float = Field(default=20.0, gt=0)
    """Deadline of one reset, step or end: past it the instance is killed and replaced, and the
    episodes it held fail with reason `timeout`."""
    start_seconds: float = Field(default=60.0, gt=0)
    """Deadline for a fresh instance to load the environment and say it is ready."""
    memory_mb: int = Field(default=2048, ge=16)
    """Memory cap of one instance with everything it started (PSS, read from /proc after
    requests): over it the instance is replaced and its episodes fail with reason `memory`."""
    state_dir: str | None = None
    """Keeps the server's signing key (`envd_key.pem`) across restarts; default: a new key per start."""
    num_servers: int = Field(default=1, ge=0, le=256)
    """Env servers the local launcher (`decentrl demo`) and `decentrl launch ray` start for a run
    whose task is served (`task.served`)."""
