"""One run of `decentrl bench wan`: a coordinator, trainer and verifier on this machine's loopback
(the data centre), a fleet of workers behind emulated access links, run until the trainer's
held-out evaluation reaches the threshold or the budget is spent."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.wan.fleet import Churn, CpuShares, Fleet, Zygote, alive, churn_schedule, signal_pid
from benchmarks.wan.link import LinkSpec
from benchmarks.wan.measure import loads, reach_seconds, store_facts, summarise_reach
from decentrl.config import RunConfig, load_config
from decentrl.launch.local import with_loopback_peers

START_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Cell:
    mode: str
    """decentrl (max_staleness as shipped by the bench), barrier (0) or nolatency (decentrl, no link)."""
    rtt_ms: float
    seed: int

    @property
    def name(self) -> str:
        return f"{self.mode}-rtt{self.rtt_ms:g}-seed{self.seed}"


def cell_config(cell: Cell, base: Path | str, overrides: list[str], settings: dict) -> RunConfig:
    """The run's config: the same run for every mode, apart from the staleness bound and, for the
    barrier, room for exactly one batch (every batch from the current version, as an on-policy
    framework dispatches it over its workers and waits)."""
    config = load_config(base, overrides)
    groups = config.trainer.groups_per_step
    barrier = cell.mode == "barrier"
    sets = [
        f"seed={cell.seed}",
        "model.seed=0",  # every run starts from the same warm start
        f"coordinator.max_staleness={0 if barrier else settings['max_staleness']}",
        f"coordinator.max_pending_groups={groups if barrier else config.coordinator.max_pending_groups}",
        f"worker.groups_per_lease={settings['groups_per_lease']}",
        f"trainer.eval_every={settings['eval_every']}",
        "trainer.num_steps=100000",
        # every worker reaches the coordinator through a proxy on 127.0.0.1
        "service.max_connections_per_address=1024",
        "service.max_requests_per_address=256",
    ]
    return with_loopback_peers(load_config(base, [*overrides, *sets]))


def link_spec(cell: Cell, settings: dict) -> LinkSpec:
    if cell.mode == "nolatency":
        return LinkSpec()
    rtt = cell.rtt_ms / 1000
    bandwidth = settings["bandwidth_mbit"] * 1e6 / 8 if settings["bandwidth_mbit"] else None
    return LinkSpec(
        rtt_s=rtt,
        jitter_s=rtt * settings["jitter"],
        bandwidth_bytes_per_s=bandwidth,
        drop_rate=settings["drop_rate"],
        stall_rate=settings["stall_rate"],
        stall_s=settings["stall_s"],
    )


def wait_for(condition, what: str, pids: list[int], timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline or not all(alive(pid) for pid in pids):
            raise RuntimeError(f"{what} did not happen within {timeout:.0f} s or a role died")
        time.sleep(0.1)


def latest_eval(db_path: Path) -> tuple[int, float] | None:
    """(version, held-out accuracy) of the last evaluation the trainer reported."""
    try:
        db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5)
        try:
            rows = db.execute(
                "SELECT version, metrics FROM train_metrics ORDER BY version DESC LIMIT 20"
            ).fetchall()
        finally:
            db.close()
    except sqlite3.Error:
        return None
    for version, metrics in rows:
        value = json.loads(metrics).get("eval_accuracy")
        if value is not None and version > 0:
            return version, value
    return None


def first_version_at(db_path: Path) -> float | None:
    if not db_path.is_file():
        return None
    try:
        db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5)
        try:
            return db.execute("SELECT MIN(created) FROM weights").fetchone()[0]
        finally:
            db.close()
    except sqlite3.Error:
        return None


def stop_pid(pid: int, grace_s: float = 30.0) -> None:
    signal_pid(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    signal_pid(pid, signal.SIGKILL)


def run_cell(
    cell: Cell, base: Path | str, overrides: list[str], settings: dict, model_dir: Path, out: Path
) -> dict:
    """Run one cell into `out` and return its measurements."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    run_dir = out / "run"
    config = cell_config(cell, base, overrides, settings)
    config_path = out / "config.json"
    config_path.write_text(config.model_dump_json(indent=2))
    common = ["--config", str(config_path)]
    zygote = Zygote(out / "logs" / "zygote.log")
    cpu = CpuShares(f"{cell.name}-{int(time.time())}")
    roles: list[int] = []
    fleet = churn = None
    try:
        coordinator = zygote.start(
            "coordinator",
            ["coordinator", *common, "--run-dir", str(run_dir), "--model-dir", str(model_dir), "--port", "0"],
            out / "logs" / "coordinator.log",
        )
        roles.append(coordinator)
        wait_for(lambda: (run_dir / "coordinator.json").is_file(), "the coordinator's start", roles)
        endpoint = json.loads((run_dir / "coordinator.json").read_text())
        url, trainer_token = endpoint["url"], endpoint["trainer_token"]
        role_args = [*common, "--coordinator", url, f"--token={trainer_token}"]
        roles.append(
            zygote.start(
                "trainer",
                ["trainer", *role_args, "--run-dir", str(run_dir), "--model-dir", str(model_dir)],
                out / "logs" / "trainer.log",
                {"OMP_NUM_THREADS": "1"},
            )
        )
        if config.trust.verify_fraction > 0:
            roles.append(
                zygote.start(
                    "verifier",
                    ["verifier", *role_args, "--model-dir", str(model_dir)],
                    out / "logs" / "verifier.log",
                    {"OMP_NUM_THREADS": "1"},
                )
            )
        port = int(url.rsplit(":", 1)[1])
        speeds = [settings["speeds"][i % len(settings["speeds"])] for i in range(settings["workers"])]
        fleet = Fleet(
            zygote,
            cpu,
            port,
            link_spec(cell, settings),
            speeds,
            settings["nat_share"],
            settings["fleet_cores"],
            out,
            cell.seed,
        )
        for worker in fleet.workers:
            fleet.start(worker, config_path, endpoint["enroll_token"])
        db = run_dir / "coordinator.db"
        wait_for(lambda: first_version_at(db) is not None, "version 0", roles)
        started = time.time()
        schedule = churn_schedule(
            cell.seed,
            len(fleet.workers),
            settings["churn_per_minute"],
            settings["budget_s"],
            settings["downtime_s"],
        )
        churn = Churn(fleet, schedule, config_path, endpoint["enroll_token"], started)
        churn.start()
        reached = None
        # until the threshold is reached and `min_s` have passed (rates, churn and reach are
        # measured over that window), or the budget is spent
        while time.time() - started < settings["budget_s"]:
            if not all(alive(pid) for pid in roles):
                raise RuntimeError(f"a role died; see {out / 'logs'}")
            last = latest_eval(db)
            if reached is None and last is not None and last[1] >= settings["threshold"]:
                reached = last
            if reached is not None and time.time() - started >= settings["min_s"]:
                break
            time.sleep(1.0)
        stop = time.time()
    finally:
        if churn is not None:
            churn.done.set()
            churn.join(5)
        if fleet is not None:
            fleet.close()
        for pid in reversed(roles):
            stop_pid(pid)
        zygote.close()
        cpu.close()
    assert fleet is not None  # the try above completed
    facts = store_facts(run_dir / "coordinator.db", settings["threshold"], stop)
    published = facts.pop("published")
    lives = {w.name: w.online for w in fleet.workers}
    loaded = {w.name: loads(out / "logs" / f"{w.name}.log") for w in fleet.workers}
    # a version published in the run's last `censor_s` had no time to spread: not counted
    reach = reach_seconds(
        {v: at for v, at in published.items() if at <= stop - settings["censor_s"]}, loaded, lives
    )
    traffic = {
        "coordinator_bytes": sum(w.link.traffic.bytes_up + w.link.traffic.bytes_down for w in fleet.workers),
        "peer_bytes": sum(
            w.peer_link.traffic.bytes_up + w.peer_link.traffic.bytes_down
            for w in fleet.workers
            if w.peer_link
        ),
        "drops": sum(link.drops for link in fleet.links()),
        "stalls": sum(link.stalls for link in fleet.links()),
    }
    versions = max(facts["versions"], 1)
    result = {
        "cell": cell.name,
        "mode": cell.mode,
        "rtt_ms": 0.0 if cell.mode == "nolatency" else cell.rtt_ms,
        "seed": cell.seed,
        "reached": reached,
        "wall_s": round(stop - started, 1),
        **facts,
        "bytes_per_version": round((traffic["coordinator_bytes"] + traffic["peer_bytes"]) / versions),
        "traffic": traffic,
        "reach_90": summarise_reach(reach),
        "cpu_shares": cpu.kind,
        "workers": [
            {
                "name": w.name,
                "share_of_core": round(w.share, 4),
                "nat": w.nat,
                "lives": len(w.online),
                "exits": w.exits,
            }
            for w in fleet.workers
        ],
        "churn": churn.events if churn is not None else [],
    }
    result["time_to_threshold_s"] = result.pop(f"time_to_{settings['threshold']}_s", None)
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    (out / "cell.json").write_text(json.dumps(result, indent=2))
    return result
