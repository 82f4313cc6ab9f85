"""`decentrl demo`: the whole system on one machine, each role its own process on loopback.

Warm start -> coordinator, trainer and workers as processes with a live progress view (the
held-out eval of the warm start runs beside them) -> held-out eval of the last published
version -> summary.json + learning curve.

The demo forks its roles (`launch/fork.py`): the coordinator as soon as the model directory is
known, the others once this process has imported their modules, while the coordinator starts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path

from decentrl.client import CoordinatorClient
from decentrl.config import LOOPBACK_NETWORKS, ConfigError, RunConfig
from decentrl.launch.evaluation import EvaluationAside, held_out_accuracy
from decentrl.launch.fork import ForkedProcess, RoleFailed, can_fork, fork_role, preload
from decentrl.launch.parent import ENV as PARENT_ENV
from decentrl.model.resolve import resolve_model_dir
from decentrl.monitor.progress import ProgressView
from decentrl.stage_map import StageMap
from decentrl.writable_dir import writable_dir

STARTUP_TIMEOUT_S = 120.0


class Role:
    """A role running as `python -m decentrl ...`, its output in `run_dir/logs/<name>.log`.

    With `fork` (and no other `python`), forked from this process instead of started afresh:
    the same command, arguments and environment, without importing everything again."""

    def __init__(
        self, name: str, args: list[str], run_dir: Path, python: str | None = None, fork: bool = False
    ):
        log_dir = run_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        env = {
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            PARENT_ENV: str(os.getpid()),  # the role stops itself if this launcher dies
        }
        self.process: subprocess.Popen | ForkedProcess
        if fork and python is None and can_fork():
            self.process = fork_role(name, args, self._log.fileno(), env)
        else:
            self.process = subprocess.Popen(
                [python or sys.executable, "-m", "decentrl", *args],
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
            )

    def alive(self) -> bool:
        return self.process.poll() is None

    def last_line(self) -> str:
        """The last line its log holds (what it said before it exited), or ''."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - 4096))
                lines = log.read().decode(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1].strip() if lines else ""

    def stop(self, timeout: float = 30.0) -> int:
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.wait()  # already reaped: its exit status


def wait_for_coordinator(run_dir: Path, role: Role) -> dict:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    path = run_dir / "coordinator.json"
    while time.monotonic() < deadline:
        if path.is_file():
            return json.loads(path.read_text())
        if not role.alive():
            raise RoleFailed(f"the coordinator exited at start; see {role.log_path}")
        time.sleep(0.02)
    raise RoleFailed(f"the coordinator did not start within {STARTUP_TIMEOUT_S:.0f} s; see {role.log_path}")


class ExitWatch:
    """The roles that must outlive the trainer for it to finish: a run whose coordinator,
    verifier, scorer or env server failed, or whose workers all failed while the trainer samples
    nothing itself, would wait forever for rollouts. `check()` raises `RoleFailed` naming the role,
    its exit status, its log and its last line, instead."""

    def __init__(self, view: ProgressView, trainer_samples: bool):
        self.view = view
        self.trainer_samples = trainer_samples
        self.needed: list[Role] = []
        self.workers: list[Role] = []
        self._reported: set[str] = set()

    def check(self) -> None:
        for role in self.needed:
            status = role.process.poll()
            if status not in (None, 0):
                raise self.failure(role, status)
        failed = [(role, role.process.poll()) for role in self.workers]
        failed = [(role, status) for role, status in failed if status not in (None, 0)]
        if failed and len(failed) == len(self.workers) and not self.trainer_samples:
            role, status = failed[-1]
            raise self.failure(role, status, "no worker is left to generate rollouts")
        for role, status in failed:  # the others go on without it: said once
            if role.name not in self._reported:
                self._reported.add(role.name)
                self.view.say(
                    f"{role.name} exited (status {status}): {role.last_line()}; see {role.log_path}"
                )

    @staticmethod
    def failure(role: Role, status: int | None, why: str = "the run cannot go on without it") -> RoleFailed:
        said = role.last_line()
        return RoleFailed(
            f"{role.name} exited (status {status}) before the trainer finished; {why}. "
            f"See {role.log_path}" + (f"; its last line: {said}" if said else "")
        )


def default_run_dir() -> Path:
    return Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")


def reward_model_paths(config: RunConfig) -> list[tuple[str, str]]:
    """(term, model directory) of the reward models a local run serves: one `decentrl scorer` per
    `reward_model` term, on its `args.path`."""
    from decentrl.config.rewards import RewardName

    paths = []
    for term in config.reward.terms:
        if term.function == RewardName.REWARD_MODEL:
            if "path" not in term.args:
                raise ConfigError(
                    f"reward term {term.label!r}: a local run needs args.path, the reward model directory "
                    "(from decentrl train-rm)"
                )
            paths.append((term.label, str(term.args["path"])))
    return paths


def with_loopback_peers(config: RunConfig) -> RunConfig:
    """The workers started here serve each other chunks on this machine's loopback: the coordinator
    lists such peers for this run (a public coordinator lists only globally routable ones)."""
    own = config.weights.peer_networks
    networks = own + [net for net in LOOPBACK_NETWORKS if net not in own]
    return config.model_copy(
        update={"weights": config.weights.model_copy(update={"peer_networks": networks})}
    )


def worker_names(config: RunConfig, model_dir: Path) -> list[tuple[str, int | None]]:
    """`demo.num_workers` workers; in a staged run, that many holders of every stage (stage 0's
    drive the leases through the others)."""
    model_config = json.loads((model_dir / "config.json").read_text())
    stage_map = StageMap.for_model(config.model.num_stages, config.model.stage_layers, model_config)
    if stage_map is None:
        return [(f"worker-{index}", None) for index in range(config.demo.num_workers)]
    return [
        (f"stage{stage}-{index}", stage)
        for stage in range(stage_map.num_stages)
        for index in range(config.demo.num_workers)
    ]


def run_roles(
    config: RunConfig,
    run_dir: Path,
    model_dir: Path,
    view: ProgressView,
    once_started: Callable[[], object] = lambda: None,
) -> tuple[dict, dict]:
    """Coordinator, trainer and workers until the trainer has published its last version;
    `once_started` runs here once every role has been started. Returns the coordinator's final
    stats and the last published weights (verified state)."""
    config = with_loopback_peers(config)
    config_path = run_dir / "config.json"
    config_path.write_text(config.model_dump_json(indent=2))
    common = ["--config", str(config_path)]
    scorers = reward_model_paths(config)
    with ExitStack() as stack:
        coordinator = Role(
            "coordinator",
            ["coordinator", *common, "--run-dir", str(run_dir), "--model-dir", str(model_dir), "--port", "0"],
            run_dir,
            fork=True,  # before this process imports torch: the coordinator needs none of it
        )
        stack.callback(coordinator.stop)
        watch = ExitWatch(view, trainer_samples=config.trainer.local_groups > 0)
        watch.needed.append(coordinator)
        # While the coordinator starts: the other roles' imports, done once for all of them.
        # The trainer's own rollouts are trusted; stage trainers verify their own stages themselves
        # (trainer/stage_verification.py).
        verify = (
            config.trust.verify_fraction > 0
            and config.demo.num_workers > 0
            and config.trainer.pipeline_stages == 1
        )
        commands = ["trainer"] + (["worker"] if config.demo.num_workers else [])
        commands += ["verifier"] if verify else []
        commands += ["scorer"] if scorers else []
        commands += ["envd"] if config.task.served else []
        preload(commands)
        endpoint = wait_for_coordinator(run_dir, coordinator)
        url = endpoint["url"]
        if endpoint.get("dashboard_url"):
            view.say(f"dashboard (live, read-only): {endpoint['dashboard_url']}")
        trainer = Role(
            "trainer",
            [
                "trainer",
                *common,
                "--coordinator",
                url,
                f"--token={endpoint['trainer_token']}",
                "--run-dir",
                str(run_dir),
                "--model-dir",
                str(model_dir),
            ],
            run_dir,
            fork=True,
        )
        stack.callback(trainer.stop)
        if verify:
            verifier = Role(
                "verifier",
                ["verifier", *common, "--coordinator", url, f"--token={endpoint['trainer_token']}"]
                + ["--model-dir", str(model_dir)],
                run_dir,
                fork=True,
            )
            stack.callback(verifier.stop)
            watch.needed.append(verifier)
        for term, path in scorers:
            scorer = Role(
                f"scorer-{term}",
                ["scorer", *common, "--coordinator", url, f"--token={endpoint['trainer_token']}"]
                + ["--reward-model", path, "--term", term],
                run_dir,
                fork=True,
            )
            stack.callback(scorer.stop)
            watch.needed.append(scorer)
        for index in range(config.envd.num_servers if config.task.served else 0):
            name = f"envd-{index}"
            envd = Role(
                name,
                ["envd", *common, "--coordinator", url, f"--token={endpoint['trainer_token']}"]
                + ["--name", name, "--state-dir", str(run_dir / name)],
                run_dir,
                fork=True,
            )
            stack.callback(envd.stop)
            watch.needed.append(envd)
        for name, stage in worker_names(config, model_dir):
            worker = Role(
                name,
                [
                    "worker",
                    *common,
                    "--coordinator",
                    url,
                    f"--token={endpoint['enroll_token']}",
                    "--name",
                    name,
                    "--state-dir",
                    str(run_dir / name),
                    *([] if stage is None else ["--stage", str(stage)]),
                ],
                run_dir,
                python=config.worker.python,  # a venv with the worker's engine (vLLM) may differ
                fork=True,
            )
            stack.callback(worker.stop)
            watch.workers.append(worker)
        once_started()
        client = stack.enter_context(CoordinatorClient(url, endpoint["trainer_token"], max_wait=60.0))
        stats = view.follow(client, trainer, config.trainer.num_steps, watch.check)
        if trainer.process.returncode != 0:
            raise RoleFailed(
                f"the trainer failed (exit {trainer.process.returncode}); see {trainer.log_path}"
            )
        latest = client.latest_weights()
        assert latest is not None, "the trainer finished without publishing"
        return stats, final_state(client, latest.version, run_dir, config.weights.store == "peers")


def warm_started_model(config: RunConfig, run_dir: Path) -> Path:
    """The model directory to start from. A warm start not cached yet is trained by `decentrl
    warmstart` in a process of its own: this one must compute nothing with torch before it forks
    the roles (an OpenMP thread pool does not survive a fork, and a forked role would hang in its
    first parallel region)."""
    from decentrl.model.warmstart_cache import cached_warm_start

    if config.model.path or cached_warm_start(config.model, config.task, config.sft) is not None:
        return resolve_model_dir(config, None)
    config_path = run_dir / "config.json"
    config_path.write_text(config.model_dump_json(indent=2))
    done = subprocess.run(
        [sys.executable, "-m", "decentrl", "warmstart", "--config", str(config_path)],
        stdout=subprocess.DEVNULL,  # the directory it prints; its progress and logs go to stderr
    )
    if done.returncode != 0:
        raise RoleFailed(f"the warm start failed (exit {done.returncode}); its output is above")
    return resolve_model_dir(config, None)


def final_state(client: CoordinatorClient, version: int, run_dir: Path, peers_only: bool = False) -> dict:
    """The published `version` as the workers see it: fetched, verified and reconstructed by the
    workers' own code path (weights/sync.py)."""
    from decentrl.weights.chunks import ChunkStore
    from decentrl.weights.peer_store import stage_chunks
    from decentrl.weights.signing import parse_public_key
    from decentrl.weights.sync import fetch_stages, fetch_state

    info = client.info()
    if info.stage_keys is not None:  # stage trainers: each stage under its own key, then together
        assert info.stage_map is not None
        stores = None
        if peers_only:  # no chunk on the coordinator: the demo's stage trainers kept theirs in run_dir
            stores = [
                ChunkStore(stage_chunks(run_dir, stage), durable=False)
                for stage in range(info.stage_map.num_stages)
            ]
        return fetch_stages(
            client, version, info.stage_keys, info.stage_map, run_dir / "final-weights", stores
        )
    key = info.trainer_public_key
    assert key is not None, "a version was published without a registered trainer key"
    return fetch_state(client, version, parse_public_key(key), run_dir / "final-weights")


def pins(facts) -> str:  # noqa: ANN001 - a release.provenance.Provenance
    """The `--trainer-key` arguments that pin a release's signers (each stage trainer's, in order)."""
    from decentrl.release.signature import fingerprint

    keys = [facts.trainer_public_key] if facts.stages is None else [s.public_key for s in facts.stages]
    return " ".join(f"--trainer-key {fingerprint(key)}" for key in keys)


def finished_line(evaluation: dict) -> str:
    """ "0.625 (accuracy among them 0.420)": the share of greedy answers that ended on their own."""
    among = evaluation["accuracy_when_finished"]
    return f"{evaluation['finished']:.3f}" + ("" if among is None else f" (accuracy among them {among:.3f})")


def write_answers(path: Path, answers: list[dict]) -> None:
    path.write_text("".join(json.dumps(answer) + "\n" for answer in answers))


def summarize(config: RunConfig, stats: dict, before: dict, after: dict, wall: dict) -> dict:
    return {
        "eval_before": before["accuracy"],
        "eval_after": after["accuracy"],
        "eval_num_problems": after["num_problems"],
        # Greedy answers that ended on their own, and the accuracy among them: a gain in the
        # latter is more than learning to finish within the token budget.
        "eval_finished_before": before["finished"],
        "eval_finished_after": after["finished"],
        "eval_when_finished_before": before["accuracy_when_finished"],
        "eval_when_finished_after": after["accuracy_when_finished"],
        "num_policy_versions": stats["latest_version"],
        "num_rollouts_accepted": stats["rollouts_accepted"],
        "num_rollouts_rejected": stats["rollouts_rejected"]["total"],
        "rejected_by_reason": stats["rollouts_rejected"]["by_reason"],
        "num_groups_expired": stats["groups_expired"],
        "num_leases_expired": stats["leases_expired"],
        "mean_staleness": stats["staleness"]["mean"],
        "staleness_histogram": stats["staleness"]["histogram"],
        "wall_seconds": wall["total"],
        "rl_wall_seconds": wall["rl"],
        "warmstart_seconds": wall["warmstart"],
        "seed": config.seed,
        "examples_after": after["examples"],
    }


def colocated(config: RunConfig, num_workers: int | None) -> RunConfig:
    """`config` with the trainer sampling a whole batch itself each version (unless it already
    samples some), `max_pending_groups` raised to the room that needs if it is lower, and, when
    given, `num_workers` workers beside it."""
    from decentrl.config import check_together
    from decentrl.config.checks import colocated_room

    trainer = config.trainer
    local = trainer.local_groups or trainer.groups_per_step
    config = config.model_copy(update={"trainer": trainer.model_copy(update={"local_groups": local})})
    room = max(config.coordinator.max_pending_groups, colocated_room(config))
    update: dict = {"coordinator": config.coordinator.model_copy(update={"max_pending_groups": room})}
    if num_workers is not None:
        update["demo"] = config.demo.model_copy(update={"num_workers": num_workers})
    config = config.model_copy(update=update)
    check_together(config)
    return config


def check_worker_python(config: RunConfig) -> None:
    """Refuse, before the warm start, a worker interpreter that is not there (a venv not built)."""
    python = config.worker.python
    if python is not None and shutil.which(python) is None:
        raise ConfigError(
            f"worker.python = {python!r} is not an executable here: build that venv (`make vllm-venv` "
            "makes .venv-vllm) or leave worker.python unset"
        )


def run_demo(config: RunConfig, run_dir: str | None) -> int:
    check_worker_python(config)
    started = time.monotonic()
    run_path = writable_dir(Path(run_dir) if run_dir else default_run_dir())
    view = ProgressView(enabled=config.demo.live and sys.stdout.isatty())
    view.say(f"decentrl demo -> {run_path}")
    model_dir = warm_started_model(config, run_path)
    warmstart_s = time.monotonic() - started
    view.say(f"warm-started model: {model_dir} ({warmstart_s:.0f} s)")
    with EvaluationAside(config, model_dir, run_path / "logs") as before_rl:
        rl_started = time.monotonic()
        # The warm start's held-out accuracy is measured while the roles run, once they are forked.
        stats, weights = run_roles(config, run_path, model_dir, view, before_rl.start)
        rl_s = time.monotonic() - rl_started
        before = before_rl.result()
    view.say(
        f"held-out accuracy before RL: {before['accuracy']:.3f} ({before['num_problems']} problems, greedy)"
    )
    from transformers.utils import logging as hf_logging

    from decentrl.eval.plots import plot_learning_curve

    hf_logging.disable_progress_bar()  # our own progress view is enough
    after = held_out_accuracy(config, model_dir, weights)
    view.say(
        f"held-out accuracy after RL:  {after['accuracy']:.3f} (v{stats['latest_version']}, RL {rl_s:.0f} s)"
    )
    view.say(f"finished answers: {finished_line(before)} before, {finished_line(after)} after")
    for moment, evaluation in (("before", before), ("after", after)):
        write_answers(run_path / f"answers-{moment}.jsonl", evaluation["answers"])
    wall = {"total": time.monotonic() - started, "rl": rl_s, "warmstart": warmstart_s}
    summary = summarize(config, stats, before, after, wall)
    (run_path / "summary.json").write_text(json.dumps(summary, indent=2))
    (run_path / "history.json").write_text(json.dumps(stats.get("history", []), indent=2))
    plot = plot_learning_curve(
        stats.get("history", []), before["accuracy"], after["accuracy"], run_path / "learning_curve.png"
    )
    if config.demo.export:
        from decentrl.release.export import export_run

        facts, evaluation = export_run(config, run_path, run_path / "model")
        assert evaluation is not None, "export_run evaluates unless told not to"
        summary["export_dir"] = str(run_path / "model")
        summary["export_eval"] = evaluation
        (run_path / "summary.json").write_text(json.dumps(summary, indent=2))
        k = config.eval.num_samples
        view.say(
            f"exported v{facts.version}: {run_path / 'model'} (held-out pass@1 greedy "
            f"{evaluation['pass@1_greedy']['value']:.3f}"
            + (f", pass@{k} {evaluation[f'pass@{k}']['value']:.3f}" if k else "")
            + f"; `decentrl verify-release {run_path / 'model'} {pins(facts)}` "
            "checks it)"
        )
    view.say(f"summary: {run_path / 'summary.json'}\nlearning curve: {plot}\nlogs: {run_path / 'logs'}")
    return 0
