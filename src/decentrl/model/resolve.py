"""Which model directory a role starts from: an explicit one, `model.path`, or the warm start."""

from __future__ import annotations

from pathlib import Path

from decentrl.config import ConfigError, RunConfig


def resolve_model_dir(config: RunConfig, explicit: str | None) -> Path:
    """--model-dir, else model.path (a local dir, or a hub id when online), else the warm start."""
    if explicit:
        path = Path(explicit)
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"--model-dir {explicit!r} has no config.json; pass a Hugging Face model directory"
            )
        return path
    if config.model.path:
        path = Path(config.model.path)
        if path.is_dir():
            return path
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(config.model.path))
        except Exception as exc:  # offline, unknown id, ...: the user must point at a local copy
            raise ConfigError(
                f"model.path {config.model.path!r} is neither a local directory nor downloadable ({exc.__class__.__name__}); "
                "pass a local model directory"
            ) from None
    from decentrl.model.warmstart import warm_start

    return warm_start(config.model, config.task, config.sft)
