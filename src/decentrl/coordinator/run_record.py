"""The run directory owns its run: one coordinator at a time, the resolved config, and its end.

- `coordinator.lock`: an exclusive `flock` held for the coordinator's life (the kernel releases it
  when the process dies, even by SIGKILL). A second coordinator on the same SQLite run directory
  is refused in one line instead of serving the run beside the first and deleting its
  `coordinator.json` on the way out. Replicas on PostgreSQL share a run directory by design
  (docs/operations.md) and take no lock.
- `config.json`: the config the run resolves to, so `decentrl eval RUN` and `decentrl export RUN`
  read the run's settings rather than the defaults. The coordinator writes its own at start; the
  trainer reports the sections only it resolves (`TRAINER_SECTIONS`: LoRA rank, number of steps,
  algorithm) with `PUT /v1/trainer/run`, kept in the store and written over them.
- The end: the trainer reports when it has published its last version; the run is then marked
  complete in the store (`RUN_COMPLETE_META`).
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from decentrl.config import ConfigError, RunConfig
from decentrl.coordinator.db.store import Database, get_meta
from decentrl.private_files import write_private_json
from decentrl.protocol import TRAINER_SECTIONS

LOCK_FILE = "coordinator.lock"
CONFIG_FILE = "config.json"
TRAINER_RUN_META = "trainer_run"
RUN_COMPLETE_META = "run_complete"


def lock_run_dir(run_dir: Path, config: RunConfig) -> int | None:
    """The descriptor holding the run directory's lock (kept open for the process's life), or None
    on PostgreSQL; a ConfigError when another coordinator holds it."""
    if config.coordinator.store != "sqlite":
        return None
    descriptor = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise ConfigError(
            f"another coordinator is serving the run directory {run_dir}{holder(run_dir)}; "
            "stop it first, or pass another --run-dir for a new run"
        ) from None
    return descriptor


def holder(run_dir: Path) -> str:
    try:
        announced = json.loads((run_dir / "coordinator.json").read_text())
        return f" (pid {announced['pid']}, {announced['url']})"
    except (OSError, ValueError, KeyError):
        return ""  # it is still starting: it announces once its socket is bound


def trainer_run(store: Database) -> dict | None:
    """What the trainer reported: {"num_steps", "sections"}, or None before it has."""
    with store.transaction() as db:
        stored = get_meta(db, TRAINER_RUN_META)
    return None if stored is None else json.loads(stored)


def write_config(run_dir: Path, config: RunConfig, store: Database) -> Path:
    """`config.json`: the coordinator's resolved config with the trainer's sections over it
    (owner-only: it holds the tokens when the config sets them). Rewritten only when it changes."""
    tree = config.model_dump(mode="json")
    reported = trainer_run(store)
    if reported is not None:
        tree.update({name: reported["sections"][name] for name in TRAINER_SECTIONS})
    path = run_dir / CONFIG_FILE
    try:
        unchanged = json.loads(path.read_text()) == tree
    except (OSError, ValueError):
        unchanged = False
    if not unchanged:
        write_private_json(path, tree)
    return path
