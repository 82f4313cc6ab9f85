"""Worker entry points: `run_worker` (set up, then loop until `stop`) and `main_worker` (the CLI's, with signals)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

from decentrl.client import CoordinatorClient, CoordinatorUnavailable, RequestRejected
from decentrl.config import ConfigError, WorkerConfig
from decentrl.engines.base import EngineUnavailable, InferenceEngine
from decentrl.engines.registry import declared_precision
from decentrl.envs.chat import ChatFormat
from decentrl.envs.player import Player
from decentrl.model.boundary_codec import Codec
from decentrl.model.stages import load_stage
from decentrl.protocol import ServerInfo
from decentrl.worker.credentials import authenticate, hold_state_dir, register
from decentrl.worker.data import DataFileMismatch, localize_env_args
from decentrl.worker.fleet import EnvFleet
from decentrl.worker.loop import Worker
from decentrl.worker.pipeline_engine import PipelineEngine
from decentrl.worker.stage_holder import MATERIALISED_FILE, hold_stage
from decentrl.worker.stage_versions import StageVersions
from decentrl.worker.weights import WeightsRefused, WorkerWeights
from decentrl.writable_dir import writable_dir

log = logging.getLogger(__name__)


def download_model_files(client: CoordinatorClient, info: ServerInfo, model_dir: Path) -> Path:
    """Fetch the run's non-weight model files (config, tokenizer) into `model_dir`."""
    model_dir.mkdir(parents=True, exist_ok=True)
    for name in info.model_files:
        assert Path(name).name == name and not name.startswith("."), f"bad model file name {name!r}"
        (model_dir / name).write_bytes(client.model_file(name))
    return model_dir


def build_engine(config: WorkerConfig, model_dir: Path, state_dir: Path) -> InferenceEngine:
    """The engine named by `config.engine`, imported lazily (they pull in torch, vLLM)."""
    from decentrl.engines.registry import ENGINES

    if config.engine != "hf" and (model_dir / "processor_config.json").is_file():
        raise ConfigError(
            f"worker.engine = {config.engine!r}: this run's policy is a vision-language model, which "
            'decentrl serves on the hf engine only; use worker.engine = "hf"'
        )

    return ENGINES[config.engine](config, model_dir, state_dir)


def check_stage(config: WorkerConfig, info: ServerInfo) -> None:
    """A staged run needs `--stage`; an unstaged one refuses it (one line, before any download)."""
    stage_map = info.stage_map
    if stage_map is None and config.stage is not None:
        raise ConfigError(f"--stage {config.stage}: this run is not staged; start the worker without --stage")
    if stage_map is not None and config.stage is None:
        raise ConfigError(
            f"this run is split into {stage_map.num_stages} pipeline stages ({stage_map.describe()}): "
            f"start each worker with --stage S, S in 0-{stage_map.last}"
        )
    if stage_map is not None and config.engine != "hf" and not config.engine.startswith("pipeline-"):
        raise ConfigError(
            f"worker.engine = {config.engine!r}: a pipeline stage runs on the model's own transformers "
            'modules; use worker.engine = "hf" in a staged run'
        )
    if stage_map is not None and config.stage is not None and config.stage > stage_map.last:
        raise ConfigError(f"--stage {config.stage}: this run's stages are 0-{stage_map.last}")


def stage_codec(info: ServerInfo) -> Codec:
    """How the run's hidden states cross stage boundaries (`model.stage_codec`, validated by the
    coordinator's config)."""
    return info.sections.get("model", {}).get("stage_codec", "bfloat16")


def driver_engine(
    client: CoordinatorClient, config: WorkerConfig, info: ServerInfo, model_dir: Path, state_dir: Path
) -> PipelineEngine:
    """The first stage, here, driving the later ones on the holders of each lease's route."""
    assert info.stage_map is not None and client.signer is not None
    dtype, device = declared_precision(config)
    stage = load_stage(model_dir, info.stage_map, 0, dtype=dtype, device=device)
    codec = stage_codec(info)
    versions = StageVersions(stage, window=config.stage_window, record=state_dir / MATERIALISED_FILE)
    return PipelineEngine(
        versions, client.signer, info.eos_token_ids, info.pad_token_id, codec=codec, coordinator=client
    )


def env_fleet(
    client: CoordinatorClient, info: ServerInfo, stop: threading.Event | None = None
) -> EnvFleet | None:
    """A served task's env servers (`fleet.py`), None when the environment runs in the worker."""
    task = info.sections.get("task", {})
    if not task.get("served"):
        return None
    if client.signer is None:
        raise ConfigError(
            "this run's task is served: env servers take only signed requests (trust.signed_requests)"
        )
    return EnvFleet(client, client.signer, int(task.get("max_env_retries", 0)), stop=stop)


def renew(client: CoordinatorClient, config: WorkerConfig, state_dir: Path) -> None:
    """Register again after the coordinator refused this worker's token (`client.renew_token`):
    the same key keeps its identity, so leases and quarantine stay with it."""
    try:
        register(client, config, state_dir)
    except ConfigError as exc:  # no enrollment token to register with: the token's refusal stands
        raise RequestRejected(401, str(exc)) from None


def run_worker(
    config: WorkerConfig, stop: threading.Event | None = None, player_type: type[Player] = Player
) -> int:
    """Serve leases until `stop` is set; returns the exit code (0 stopped, 2 refused by the coordinator).

    `player_type` plays each leased task; benchmarks pass a hostile subclass."""
    stop = stop or threading.Event()
    temporary = config.state_dir is None
    state_dir = (
        Path(tempfile.mkdtemp(prefix="decentrl-worker-"))
        if config.state_dir is None
        else Path(config.state_dir)
    )
    held = hold_state_dir(writable_dir(state_dir, "--state-dir", "state directory"))
    # Retries never give up on their own (a worker outlives coordinator restarts), except once
    # `stop` is set: then a call gets a short grace period so the worker can still exit.
    client = CoordinatorClient(config.coordinator_url, interrupt=stop)
    try:
        credentials = authenticate(client, config, state_dir)
        client.renew_token = lambda: renew(client, config, state_dir)
        info = client.info()
        check_stage(config, info)
        if config.stage == 0:  # held to the tolerance of its route's boundary codec: register as such
            config = config.model_copy(update={"engine": f"pipeline-{stage_codec(info)}"})
            authenticate(client, config, state_dir)
        model_dir = download_model_files(client, info, state_dir / "model")
        if config.stage is not None and config.stage >= 1:
            return hold_stage(client, config, info, model_dir, state_dir, credentials.worker_id, stop)
        engine = (
            build_engine(config, model_dir, state_dir)
            if config.stage is None
            else driver_engine(client, config, info, model_dir, state_dir)
        )
        env_args = localize_env_args(client, info.env_args, state_dir / "data")
        player = player_type(ChatFormat.from_model_dir(model_dir, info.eos_token_ids), env_args)
        player.fleet = env_fleet(client, info, stop)
        log.info(
            "worker %r ready: run %s, engine %s on %s",
            config.name,
            info.run_id,
            config.engine,
            getattr(engine, "device", "?"),
        )
        weights = WorkerWeights(client, engine, config, state_dir, stage=config.stage)
        try:
            worker = Worker(
                client,
                engine,
                config,
                stop,
                player=player,
                weights=weights,
            )
            return worker.run()
        finally:
            weights.close()
    except (WeightsRefused, EngineUnavailable, DataFileMismatch) as exc:
        log.error("%s", exc)
        return 2
    except RequestRejected as exc:
        log.error("the coordinator at %s refused this worker: %s", config.coordinator_url, exc)
        return 2
    except CoordinatorUnavailable as exc:
        log.warning("stopping without an answer from the coordinator: %s", exc)
        return 0 if stop.is_set() else 1
    finally:
        client.close()
        os.close(held)
        if temporary:
            shutil.rmtree(state_dir, ignore_errors=True)


def main_worker(config: WorkerConfig, player_type: type[Player] = Player) -> int:
    """CLI entry: the first SIGTERM/SIGINT finishes the current step and exits 0; a second aborts (130)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the worker's own
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        log.info(
            "%s: finishing the current step, then exiting (signal again to abort)",
            signal.Signals(signum).name,
        )
        stop.set()

    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
    code = 130
    try:
        code = run_worker(config, stop, player_type)
        return code
    except KeyboardInterrupt:
        log.warning("aborted")
        return 130
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if code == 0 and not stop.is_set():
            # It ended on its own (the run is complete): a stop its launcher sends while it exits
            # asks for what it is doing already, and must not turn exit status 0 into a kill.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
