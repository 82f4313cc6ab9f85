"""`decentrl trainer --nproc N`: the same command under `torchrun` on this machine.

torchrun (torch.distributed.run, the elastic agent) starts N ranks and, when any rank dies, stops
the others and exits non-zero. This process then starts a fresh torchrun (a new rendezvous), up to
`trainer.max_restarts` times, and the ranks resume from the sharded checkpoint. (torchrun's own
`--max-restarts` re-rendezvous hangs in gloo's connect on torch 2.13 with `--standalone`; a fresh
agent per attempt does not.) This process stays the trainer's face to its launcher: it forwards
SIGTERM and SIGINT to the agent (which forwards them to the ranks) and exits with its status.
Several nodes: run `torchrun --nnodes ... -m decentrl trainer ...` yourself (docs/scaling.md).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

log = logging.getLogger(__name__)

TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"
"""Set by `torchrun` in every rank it starts."""


def under_torchrun() -> bool:
    return TORCHRUN_ENV in os.environ and "LOCAL_RANK" in os.environ


def without_nproc(args: list[str]) -> list[str]:
    """`args` less `--nproc N` / `--nproc=N`: the ranks need not see it, and torchrun's own parser
    would take `--nproc` for an abbreviation of its `--nproc-per-node`."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def torchrun_command(nproc: int, role_args: list[str]) -> list[str]:
    """One node, a rendezvous on a free local port (`--standalone`)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "decentrl",
        *without_nproc(role_args),
    ]


def run_torchrun(nproc: int, max_restarts: int, role_args: list[str]) -> int:
    """Run `decentrl <role_args>` on `nproc` ranks until they finish, restarting the group after a
    failure (at most `max_restarts` times); returns the last agent's status."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    stopping = False
    agent: subprocess.Popen | None = None

    def forward(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        if agent is not None:
            agent.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    for attempt in range(max_restarts + 1):
        agent = subprocess.Popen(torchrun_command(nproc, role_args), env=env)
        status = agent.wait()
        if status == 0 or stopping:
            return status
        if attempt < max_restarts:
            log.warning(
                "trainer group failed (exit %d); restarting it from the sharded checkpoint (%d/%d)",
                status,
                attempt + 1,
                max_restarts,
            )
    return status
