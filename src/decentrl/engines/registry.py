"""Engines by the name `worker.engine` gives, each built from the worker's config."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from decentrl.config import WorkerConfig
from decentrl.engines.base import InferenceEngine
from decentrl.protocol import DeclaredDevice, DeclaredDtype


def _hf(config: WorkerConfig, model_dir: Path, state_dir: Path) -> InferenceEngine:
    from decentrl.engines.hf import HFEngine

    dtype = "float32" if config.dtype == "auto" else config.dtype
    return HFEngine.from_model_dir(
        model_dir, device=config.device, num_threads=config.num_threads, dtype=dtype
    )


def _vllm(config: WorkerConfig, model_dir: Path, state_dir: Path) -> InferenceEngine:
    from decentrl.engines.vllm import VLLMEngine

    return VLLMEngine(model_dir, dtype=config.dtype)


def _openai(config: WorkerConfig, model_dir: Path, state_dir: Path) -> InferenceEngine:
    from decentrl.engines.openai import OpenAIEngine

    weights_dir = Path(config.openai_weights_dir) if config.openai_weights_dir else state_dir / "served"
    return OpenAIEngine.from_worker(config.openai_url, model_dir, weights_dir)


def declared_precision(config: WorkerConfig) -> tuple[DeclaredDtype, DeclaredDevice]:
    """The dtype and device a worker declares at registration (with its engine, the class whose
    log-prob tolerance the verifier holds it to, trust/logprob_tolerance.py). An openai server computes in
    its own dtype, known to the worker only through `worker.dtype`."""
    if config.engine == "openai":
        return ("unknown" if config.dtype == "auto" else config.dtype), "unknown"
    import torch

    from decentrl.engines.hf import pick_device

    if config.engine == "vllm":
        from decentrl.engines.vllm import resolve_dtype

        on_cuda = torch.cuda.is_available()
        return resolve_dtype(config.dtype, on_cuda), "cuda" if on_cuda else "cpu"  # pyright: ignore[reportReturnType]
    device = pick_device(config.device).type
    dtype = "float32" if config.dtype == "auto" else config.dtype
    return dtype, device if device in ("cpu", "cuda", "mps") else "unknown"  # pyright: ignore[reportReturnType]


ENGINES: dict[str, Callable[[WorkerConfig, Path, Path], InferenceEngine]] = {
    "hf": _hf,
    "vllm": _vllm,
    "openai": _openai,
}
