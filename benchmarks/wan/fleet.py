"""The emulated fleet of `decentrl bench wan`: workers of different speeds behind their own access
links, some behind NAT, killed and restarted on a seeded schedule.

- **Processes** are forked by the zygote (`zygote.py`), so a restart costs a fork, not an import.
- **Speed**: each worker gets a share of one core: a cgroup of the v1 `cpu` controller
  (`cpu.cfs_quota_us` over a 100 ms period), or cgroup v2's `cpu.max`; where neither is writable,
  the bench itself stops and continues the process in each period (SIGSTOP/SIGCONT), which is
  coarser but has the same mean.
- **Links**: one `WanLink` between the worker and the coordinator; a worker that serves peers has a
  second in front of its chunk server (`worker.peer_url` names it), so a peer's download crosses
  the serving worker's access link. A worker behind NAT serves nothing (`worker.serve_peers`
  off) and only downloads.
- **Churn**: `churn_schedule` draws kills as a Poisson process of `share_per_minute` of the fleet
  per minute, each worker down for `downtime_s`, from a seed: the same schedule for every mode.
  A worker that exits by itself (too many refusals in a row) is restarted too, and counted.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import subprocess_env
from benchmarks.wan.link import LinkSpec, WanLink

PERIOD_US = 100_000
CGROUP_V1 = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")


class Zygote:
    """Forks `decentrl ROLE ...` on request (see zygote.py); thread-safe."""

    def __init__(self, log: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.wan.zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(log, "ab"),  # noqa: SIM115 - the child holds it
            text=True,
            env={**subprocess_env(), "PYTHONUNBUFFERED": "1"},
        )
        self.lock = threading.Lock()
        assert self.process.stdout is not None
        ready = self.process.stdout.readline().strip()
        if ready != "ready":
            raise RuntimeError(f"the zygote did not start (see {log})")

    def start(self, name: str, args: list[str], log: Path, env: dict[str, str] | None = None) -> int:
        request = {
            "name": name,
            "args": args,
            "log": str(log),
            "env": {"PYTHONUNBUFFERED": "1", **(env or {})},
        }
        with self.lock:
            assert self.process.stdin is not None and self.process.stdout is not None
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            return int(self.process.stdout.readline())

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(30)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by the zygote) is not alive
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def signal_pid(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


class CpuShares:
    """A share of one core per process: cgroup v1, cgroup v2, or stop/continue from here."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.kind, self.root = self._pick()
        self.duty: dict[int, float] = {}
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def _pick(self) -> tuple[str, Path | None]:
        for kind, base, quota in (
            ("cgroup-v1", CGROUP_V1, "cpu.cfs_quota_us"),
            ("cgroup-v2", CGROUP_V2, "cpu.max"),
        ):
            root = base / f"decentrl-wan-{self.tag}"
            try:
                if kind == "cgroup-v2" and "cpu" not in (base / "cgroup.controllers").read_text().split():
                    continue
                root.mkdir(exist_ok=True)
                if (root / quota).exists():
                    if kind == "cgroup-v2":
                        (base / "cgroup.subtree_control").write_text("+cpu")
                    return kind, root
                root.rmdir()
            except OSError:
                continue
        return "stop-continue", None

    def limit(self, name: str, pid: int, share: float) -> None:
        """Hold `pid` (and the threads and children it starts) to `share` of one core."""
        if self.root is None:
            self.duty[pid] = share
            if self.thread is None:
                self.thread = threading.Thread(target=self._cycle, name="wan-duty", daemon=True)
                self.thread.start()
            return
        group = self.root / name
        group.mkdir(exist_ok=True)
        quota = max(1000, int(share * PERIOD_US))
        if self.kind == "cgroup-v1":
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        (group / "cgroup.procs").write_text(str(pid))

    def _cycle(self) -> None:
        period = PERIOD_US / 1e6
        while not self.stop.is_set():
            started = time.monotonic()
            running = dict(self.duty)
            for pid in running:
                signal_pid(pid, signal.SIGCONT)
            for pid, share in sorted(running.items(), key=lambda item: item[1]):
                time.sleep(max(0.0, started + share * period - time.monotonic()))
                signal_pid(pid, signal.SIGSTOP)
            time.sleep(max(0.0, started + period - time.monotonic()))
        for pid in self.duty:
            signal_pid(pid, signal.SIGCONT)

    def forget(self, pid: int) -> None:
        self.duty.pop(pid, None)

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(2)
        if self.root is not None:
            for group in self.root.iterdir():
                if group.is_dir():
                    with contextlib.suppress(OSError):  # a process of it still exiting
                        group.rmdir()
            with contextlib.suppress(OSError):
                self.root.rmdir()


@dataclass
class Kill:
    at_s: float
    """Seconds after the fleet's start."""
    worker: int
    downtime_s: float


def churn_schedule(
    seed: int, num_workers: int, share_per_minute: float, duration_s: float, downtime_s: float
) -> list[Kill]:
    """Kills at the times of a Poisson process of `share_per_minute * num_workers` per minute,
    each of a worker up at that time (uniformly), which comes back `downtime_s` later."""
    rng = random.Random(seed)
    rate = share_per_minute * num_workers / 60.0
    kills: list[Kill] = []
    back = [0.0] * num_workers
    now = 0.0
    while rate > 0:
        now += rng.expovariate(rate)
        if now >= duration_s:
            break
        up = [index for index in range(num_workers) if back[index] <= now]
        if not up:
            continue
        worker = rng.choice(up)
        back[worker] = now + downtime_s
        kills.append(Kill(round(now, 3), worker, downtime_s))
    return kills


@dataclass
class FleetWorker:
    index: int
    name: str
    share: float
    """Share of one core."""
    nat: bool
    state_dir: Path
    link: WanLink
    peer_link: WanLink | None
    peer_port: int | None
    pid: int | None = None
    online: list[list[float | None]] = field(default_factory=list)
    """[start, end] unix times of each life (end None while alive)."""
    exits: int = 0
    """Lives that ended by themselves, not by the schedule."""

    def args(self, config: Path, token: str) -> list[str]:
        args = ["worker", "--config", str(config), "--coordinator", self.link.url, f"--token={token}"]
        args += ["--name", self.name, "--state-dir", str(self.state_dir)]
        if self.peer_link is not None:
            args += ["--set", "worker.serve_peers=true", "--set", f"worker.peer_port={self.peer_port}"]
            args += ["--set", f"worker.peer_url={self.peer_link.url}"]
        else:
            args += ["--set", "worker.serve_peers=false"]
        return args


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Fleet:
    def __init__(
        self,
        zygote: Zygote,
        shares: CpuShares,
        coordinator_port: int,
        spec: LinkSpec,
        speeds: list[float],
        nat_share: float,
        core_share: float,
        out: Path,
        seed: int,
    ) -> None:
        self.zygote, self.cpu, self.out = zygote, shares, out
        self.lock = threading.Lock()
        self.workers: list[FleetWorker] = []
        unit = core_share / sum(speeds)  # the whole fleet shares `core_share` of one core
        # who sits behind NAT: drawn from the seed, the same in every mode
        nat = set(random.Random(seed).sample(range(len(speeds)), round(len(speeds) * nat_share)))
        for index, speed in enumerate(speeds):
            peer_port = None if index in nat else free_port()
            link = WanLink("127.0.0.1", coordinator_port, spec, seed=seed * 1000 + index).start()
            peer_link = None
            if peer_port is not None:
                peer_link = WanLink("127.0.0.1", peer_port, spec, seed=seed * 1000 + 500 + index).start()
            name = f"w{index}-x{speed:g}" + ("-nat" if index in nat else "")
            worker = FleetWorker(
                index, name, unit * speed, index in nat, out / name, link, peer_link, peer_port
            )
            self.workers.append(worker)

    def start(self, worker: FleetWorker, config: Path, token: str) -> None:
        log = self.out / "logs" / f"{worker.name}.log"
        pid = self.zygote.start(worker.name, worker.args(config, token), log, {"OMP_NUM_THREADS": "1"})
        self.cpu.limit(worker.name, pid, worker.share)
        with self.lock:
            worker.pid = pid
            worker.online.append([time.time(), None])

    def kill(self, worker: FleetWorker) -> None:
        with self.lock:
            pid, worker.pid = worker.pid, None
            if worker.online and worker.online[-1][1] is None:
                worker.online[-1][1] = time.time()
        if pid is not None:
            signal_pid(pid, signal.SIGKILL)
            self.cpu.forget(pid)

    def links(self) -> list[WanLink]:
        return [link for w in self.workers for link in (w.link, w.peer_link) if link is not None]

    def close(self) -> None:
        for worker in self.workers:
            pid = worker.pid
            if pid is not None:
                signal_pid(pid, signal.SIGCONT)
                signal_pid(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for worker in self.workers:
            while worker.pid is not None and alive(worker.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            self.kill(worker)
        for link in self.links():
            link.close()


class Churn(threading.Thread):
    """Applies a kill schedule to a fleet (and restarts workers that exited by themselves)."""

    def __init__(self, fleet: Fleet, schedule: list[Kill], config: Path, token: str, started: float) -> None:
        super().__init__(name="wan-churn", daemon=True)
        self.fleet, self.schedule, self.config, self.token, self.started = (
            fleet,
            schedule,
            config,
            token,
            started,
        )
        self.done = threading.Event()
        self.events: list[dict] = []

    def run(self) -> None:
        pending = sorted(self.schedule, key=lambda kill: kill.at_s)
        returns: list[tuple[float, FleetWorker]] = []
        while not self.done.wait(0.2):
            now = time.time() - self.started
            while pending and pending[0].at_s <= now:
                kill = pending.pop(0)
                worker = self.fleet.workers[kill.worker]
                if worker.pid is not None:
                    self.fleet.kill(worker)
                    self.events.append({"at_s": round(now, 2), "kill": worker.name})
                    returns.append((now + kill.downtime_s, worker))
            for due, worker in [item for item in returns if item[0] <= now]:
                returns.remove((due, worker))
                self.fleet.start(worker, self.config, self.token)
                self.events.append({"at_s": round(now, 2), "start": worker.name})
            for worker in self.fleet.workers:
                if worker.pid is not None and not alive(worker.pid):  # it left by itself
                    worker.exits += 1
                    self.fleet.kill(worker)
                    self.fleet.start(worker, self.config, self.token)
                    self.events.append({"at_s": round(now, 2), "exit": worker.name})
