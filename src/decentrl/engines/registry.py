"""Engines by the name `worker.engine` gives, each built from the worker's config."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from decentrl.config import WorkerConfig
from decentrl.engines.base import InferenceEngine


def _hf(config: WorkerConfig, model_dir: Path, state_dir: Path) -> InferenceEngine:
    from decentrl.engines.hf import HFEngine

    return HFEngine.from_model_dir(model_dir, device=config.device, num_threads=config.num_threads)


def _vllm(config: WorkerConfig, model_dir: Path, state_dir: Path) -> InferenceEngine:
    from decentrl.engines.vllm import VLLMEngine

    return VLLMEngine(model_dir, dtype=config.dtype)


def _openai(config: WorkerConfig, model_dir: Path, state_dir: Path) -> InferenceEngine:
    from decentrl.engines.openai import OpenAIEngine

    weights_dir = Path(config.openai_weights_dir) if config.openai_weights_dir else state_dir / "served"
    return OpenAIEngine.from_worker(config.openai_url, model_dir, weights_dir)


ENGINES: dict[str, Callable[[WorkerConfig, Path, Path], InferenceEngine]] = {
    "hf": _hf,
    "vllm": _vllm,
    "openai": _openai,
}
