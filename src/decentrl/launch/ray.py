"""`decentrl launch ray --config FILE`: the whole system as Ray actors, on a cluster or this machine.

Each role is a Ray actor that runs the role's usual command (`python -m decentrl <role> ...`) as its
child process, with the CPUs and GPUs the config reserves for it (`[ray.<role>]`); the child sees
the GPUs Ray gave the actor (CUDA_VISIBLE_DEVICES) and stops itself if the actor dies
(`DECENTRL_PARENT_PID`). So the roles behave exactly as under `decentrl demo`; Ray places them,
restarts them and tears them down.

- The coordinator's actor is pinned to one node (`ray.coordinator_node`, default the driver's):
  its run directory (SQLite store, weights) lives on that node's disk and must outlive restarts.
- The trainer's actor runs `decentrl trainer` with `trainer.nproc` ranks (torchrun + FSDP2 on
  that node; reserve `ray.trainer.num_gpus = trainer.nproc`).
- A scorer actor per `reward_model` term of the rubric runs `decentrl scorer` on the term's
  `args.path` (`[ray.scorer]` resources; a GPU makes it score on CUDA), restarted like a worker.
- Worker actors restart without limit: when a worker process exits or its actor dies, Ray starts
  the actor again and it starts a fresh worker with the same state directory (same identity).
- A served task (`task.served`) gets `envd.num_servers` env-server actors (`decentrl envd`,
  `[ray.envd]` resources), restarted like workers; each keeps its signing key in its state
  directory, so a restarted server signs with the key the coordinator already knows.
- Workers outside the cluster join the same coordinator with its URL and enrollment token.
- Ctrl-C (or SIGTERM) stops every role gracefully, kills the actors and, for a local cluster,
  shuts Ray down.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

from decentrl.config import ConfigError, RunConfig

STARTUP_TIMEOUT_S = 180.0
POLL_SECONDS = 1.0


class RoleActor:
    """One role's process under a Ray actor (wrapped with `ray.remote` at launch)."""

    def __init__(self, name: str, args: list[str], run_dir: str, config_json: str, restart_on_exit: bool):
        from decentrl.launch.local import Role

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.run_dir / "config.json"  # the same text on every node
        # Every actor (re)writes it, possibly while a role reads it: each writes a copy and renames.
        staging = self.run_dir / f"config.json.{os.getpid()}"
        staging.write_text(config_json)
        staging.rename(config_path)
        self.stopping = False
        self.role = Role(name, [args[0], "--config", str(config_path), *args[1:]], self.run_dir)
        if restart_on_exit:
            threading.Thread(target=self._exit_with_role, daemon=True).start()

    def _exit_with_role(self) -> None:
        """A worker that fails ends its actor, so that Ray restarts both. One that exits 0 is done
        (the run is complete): restarting it would only have it exit again."""
        if self.role.process.wait() != 0 and not self.stopping:
            os._exit(1)

    def endpoint(self, timeout: float) -> dict:
        """The coordinator's `coordinator.json`, its URL made reachable from other nodes."""
        import ray

        path = self.run_dir / "coordinator.json"
        deadline = time.monotonic() + timeout
        while not path.is_file():
            if time.monotonic() > deadline or not self.role.alive():
                raise RuntimeError(f"the coordinator did not start; see {self.role.log_path}")
            time.sleep(0.2)
        endpoint = json.loads(path.read_text())
        host = json.loads((self.run_dir / "config.json").read_text())["coordinator"]["host"]
        if host in ("0.0.0.0", ""):  # bound to every interface: other nodes use this node's address
            port = endpoint["url"].rsplit(":", 1)[1]
            endpoint["url"] = f"http://{ray.util.get_node_ip_address()}:{port}"
        return endpoint

    def info(self) -> dict:
        import ray

        return {"pid": os.getpid(), "role_pid": self.role.process.pid, "node": ray.util.get_node_ip_address()}

    def exit_code(self) -> int | None:
        return self.role.process.poll()

    def stop(self) -> int:
        self.stopping = True
        return self.role.stop()


def connect(config: RunConfig) -> dict:
    """Join the configured cluster or start a local one; returns where to look."""
    import ray

    options: dict = {"namespace": "decentrl", "log_to_driver": False}
    if config.ray.address:
        context = ray.init(address=config.ray.address, **options)
    else:
        context = ray.init(
            num_cpus=config.ray.num_cpus,
            include_dashboard=config.ray.include_dashboard,
            object_store_memory=100 * 1024 * 1024,  # roles talk HTTP; Ray's object store stays idle
            **options,
        )
    return {
        "dashboard": context.dashboard_url or None,
        "ray_logs": str(Path(context.address_info["session_dir"]) / "logs"),
    }


def coordinator_node_id(config: RunConfig) -> str:
    import ray

    if config.ray.coordinator_node is None:
        return ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["Alive"] and node["NodeManagerAddress"] == config.ray.coordinator_node:
            return node["NodeID"]
    raise ConfigError(f"ray.coordinator_node {config.ray.coordinator_node!r} is no live node of the cluster")


def launch_ray(config: RunConfig, run_dir: Path, model_dir: Path) -> int:
    """Start every role as an actor, wait for the trainer to finish (or Ctrl-C), tear down."""
    from decentrl.launch.local import reward_model_paths

    try:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    except ImportError:
        raise ConfigError("the Ray launcher needs Ray: pip install 'decentrl[ray]'") from None

    run_dir = run_dir.resolve()
    where = connect(config)
    config_json = config.model_dump_json(indent=2)
    Actor = ray.remote(RoleActor)
    actors: list = []

    def start(name: str, args: list[str], resources, restart: bool = False, **options):
        actor = Actor.options(
            name=name,
            num_cpus=resources.num_cpus,
            num_gpus=resources.num_gpus,
            max_restarts=-1 if restart else 0,
            **options,
        ).remote(name, args, str(run_dir), config_json, restart)
        actors.append(actor)
        return actor

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # SIGINT too, explicitly: a launcher started in the background (`&`, nohup) inherits SIGINT
    # ignored, and Python then raises no KeyboardInterrupt for it.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, interrupt)
    try:
        pinned = NodeAffinitySchedulingStrategy(coordinator_node_id(config), soft=False)
        coordinator = start(
            "coordinator",
            ["coordinator", "--run-dir", str(run_dir), "--model-dir", str(model_dir), "--port", "0"],
            config.ray.coordinator,
            scheduling_strategy=pinned,
        )
        endpoint = ray.get(coordinator.endpoint.remote(STARTUP_TIMEOUT_S))
        url, trainer_token = endpoint["url"], endpoint["trainer_token"]
        trainer = start(
            "trainer",
            ["trainer", "--coordinator", url, f"--token={trainer_token}", "--run-dir", str(run_dir)]
            + ["--model-dir", str(model_dir)],
            config.ray.trainer,
        )
        if config.trust.verify_fraction > 0:
            start(
                "verifier",
                ["verifier", "--coordinator", url, f"--token={trainer_token}", "--model-dir", str(model_dir)],
                config.ray.verifier,
            )
        for term, path in reward_model_paths(config):
            # A scorer holds no state: like a worker it is restarted whenever it dies, and the
            # coordinator hands its unanswered jobs out again. `path` must exist on its node.
            start(
                f"scorer-{term}",
                ["scorer", "--coordinator", url, f"--token={trainer_token}", "--reward-model", path]
                + ["--term", term],
                config.ray.scorer,
                restart=True,
            )
        for index in range(config.envd.num_servers if config.task.served else 0):
            name = f"envd-{index}"
            start(
                name,
                ["envd", "--coordinator", url, f"--token={trainer_token}", "--name", name]
                + ["--state-dir", str(run_dir / name)],
                config.ray.envd,
                restart=True,
            )
        for index in range(config.ray.num_workers):
            name = f"ray-worker-{index}"
            start(
                name,
                ["worker", "--coordinator", url, f"--token={endpoint['enroll_token']}", "--name", name]
                + ["--state-dir", str(run_dir / name)],
                config.ray.worker,
                restart=True,
            )
        announce(run_dir, url, endpoint["enroll_token"], where)
        while (status := ray.get(trainer.exit_code.remote())) is None:
            if ray.get(coordinator.exit_code.remote()) is not None:
                raise ConfigError(f"the coordinator exited; see {run_dir / 'logs' / 'coordinator.log'}")
            time.sleep(POLL_SECONDS)
        print(f"trainer finished (exit {status}); stopping the roles", flush=True)
        return status
    except KeyboardInterrupt:
        print("interrupted: stopping the roles", flush=True)
        return 130
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):  # a second signal must not cut the teardown short
            signal.signal(signum, signal.SIG_IGN)
        teardown(actors)


def announce(run_dir: Path, url: str, enroll_token: str, where: dict) -> None:
    state = {"coordinator_url": url, **where}
    staging = run_dir / "ray.json.tmp"
    staging.write_text(json.dumps(state, indent=2))
    staging.rename(run_dir / "ray.json")  # atomic: a reader never sees a half-written file
    print(f"coordinator: {url} (run directory {run_dir} on its node)", flush=True)
    print(f"Ray dashboard: {where['dashboard'] or 'off (ray.include_dashboard)'}", flush=True)
    print(f"role logs: {run_dir / 'logs'} on each role's node; Ray's logs: {where['ray_logs']}", flush=True)
    print(
        f"workers outside the cluster join with: decentrl worker --coordinator {url} --token={enroll_token}",
        flush=True,
    )


def teardown(actors: list) -> None:
    """Workers first, the coordinator last; each role gets its graceful stop, then its actor goes."""
    import ray

    for actor in reversed(actors):
        try:
            ray.get(actor.stop.remote(), timeout=60)
        except Exception as exc:  # a dead actor or a hung role: kill it regardless, but say so
            print(f"teardown: {exc.__class__.__name__} while stopping a role; killing its actor", flush=True)
        ray.kill(actor, no_restart=True)
    ray.shutdown()
