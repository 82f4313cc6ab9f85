"""What `decentrl eval` evaluates: a model directory, a run's published version or an endpoint.

A source is told apart by what it is: a URL is an OpenAI-compatible endpoint; a directory with a
`coordinator.db` is a run, whose version (the latest by default) is rebuilt through the signed
weights path (weights/run_dir.py); a directory with a `config.json` is a Hugging Face model.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from decentrl.config import ConfigError, RunConfig
from decentrl.engines.base import InferenceEngine
from decentrl.envs.chat import ChatFormat
from decentrl.model.special import read_eos_token_ids, read_max_context, read_pad_token_id
from decentrl.weights.run_dir import store_location


@dataclass
class Target:
    engine: InferenceEngine
    chat: ChatFormat
    label: str
    """What was evaluated, for the report: a path, `run@vN (sha256 ...)` or a URL."""
    max_context: int | None = None
    """The model's context length (its config.json), which bounds multi-turn episodes."""


def is_endpoint(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def is_run_dir(source: str) -> bool:
    return store_location(Path(source)) is not None


def hf_engine(model_dir: Path, config: RunConfig, state: dict | None = None):
    """`model_dir` on the hf engine (the trainer's device and dtype, `Precision.for_evaluation`),
    with the published `state` (LoRA adapters served unmerged) when given."""
    from decentrl.engines.hf import HFEngine
    from decentrl.model.precision import Precision
    from decentrl.model.vision import PixelInputs, load_policy

    precision = Precision.for_evaluation(config)
    model = load_policy(model_dir, precision.dtype)
    engine = HFEngine(
        model,
        read_eos_token_ids(model_dir),
        read_pad_token_id(model_dir),
        device=str(precision.device),
        pixels=PixelInputs.from_model_dir(model_dir),
    )
    if state is not None:
        engine.load_weights(state, version=0)
    return engine


def load_target(source: str, config: RunConfig, model_dir: Path | None, version: int | None) -> Target:
    """The engine and chat format of `source`; `model_dir` supplies the tokenizer and architecture
    of a run or an endpoint (default: the run's own model, `model/resolve.py`)."""
    settings = config.eval
    if is_endpoint(source) or settings.engine == "openai":
        from decentrl.engines.endpoint import EndpointEngine

        url = source if is_endpoint(source) else settings.endpoint
        if url is None:
            raise ConfigError("eval.engine = 'openai' needs an endpoint: pass its URL as the source")
        if model_dir is None:
            raise ConfigError("evaluating an endpoint needs its tokenizer: add --model-dir DIR")
        chat = ChatFormat.from_model_dir(model_dir, read_eos_token_ids(model_dir))
        engine = EndpointEngine(url, chat.tokenizer, chat.eos_token_ids, settings.endpoint_model)
        return Target(engine, chat, f"{url} ({engine.model})", read_max_context(model_dir))
    path = Path(source)
    if is_run_dir(source):
        from decentrl.model.resolve import resolve_model_dir
        from decentrl.release.stage_release import StageRun, rebuild, stage_keys_of
        from decentrl.weights.run_dir import RunWeights, reconstruct

        model_dir = resolve_model_dir(config, str(model_dir) if model_dir else None)
        if stage_keys_of(path) is not None:  # stage trainers: every stage under its own key (RUN/trainer)
            staged = StageRun(path, path / "trainer")
            chosen = staged.latest_version if version is None else version
            state, _, _ = rebuild(staged, chosen)
            versions = staged.versions
        else:
            run = RunWeights(path)
            chosen = run.latest_version if version is None else version
            with tempfile.TemporaryDirectory(prefix="decentrl-eval-") as cache:
                state, _ = reconstruct(run, chosen, Path(cache))
            versions = run.versions
        engine = hf_engine(model_dir, config, state)
        chat = ChatFormat.from_model_dir(model_dir, read_eos_token_ids(model_dir))
        label = f"{path}@v{chosen} (state {versions[chosen][:12]})"
        return Target(engine, chat, label, read_max_context(model_dir))
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"{source!r} is neither a model directory (config.json), a run directory (coordinator.db or a PostgreSQL store) "
            "nor an http(s):// endpoint"
        )
    if version is not None:
        raise ConfigError("--version applies to a run directory, not to a model directory")
    chat = ChatFormat.from_model_dir(path, read_eos_token_ids(path))
    return Target(hf_engine(path, config), chat, str(path), read_max_context(path))
