"""A process that imports the roles' modules once and forks a role on request: how `decentrl bench
wan` starts, and restarts after each kill, its many short-lived processes cheaply.

A worker under a CPU quota of a few percent of a core would spend minutes importing torch; forked
from here it starts with its modules in memory, as `decentrl demo` forks its roles
(`launch/fork.py`). The bench cannot fork them itself: its proxies run threads, and a fork is only
safe from a process with one thread. This one has none: it reads one JSON request per line on
stdin (`{"name", "args", "log", "env"}`), forks `decentrl ARGS` with its output appended to `log`,
answers the child's pid on stdout, and reaps the children that exit. It stops at end of input;
its children, watching it (`launch/parent.py`), stop then too.

Run as `python -m benchmarks.wan.zygote`.
"""

from __future__ import annotations

import json
import os
import select
import sys

from decentrl.launch.fork import can_fork, fork_role, preload
from decentrl.launch.parent import ENV as PARENT_ENV

ROLES = ["coordinator", "trainer", "worker", "verifier"]


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def serve() -> int:
    preload(ROLES)
    assert can_fork(), "the zygote must hold one thread to fork safely"
    print("ready", flush=True)
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.5)
        reap()
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:
            return 0
        request = json.loads(line)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        env = {**request["env"], PARENT_ENV: str(os.getpid())}
        child = fork_role(request["name"], request["args"], log, env)
        os.close(log)
        print(child.pid, flush=True)


if __name__ == "__main__":
    sys.exit(serve())
