"""Where the SFT warm start is cached, and whether it already is, without importing torch.

Every launch asks this first; only a missing entry needs the recipe (`model/warmstart.py`) and
the ML stack behind it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from decentrl.config import ModelConfig, SFTConfig, TaskConfig

log = logging.getLogger("decentrl.model.warmstart")
WARMSTART_FORMAT = 1  # bump when the recipe in model/warmstart.py changes, to invalidate old caches
STAGING_FIELDS = ("num_stages", "stage_layers", "stage_codec")


def cache_root(sft: SFTConfig) -> Path:
    if sft.cache_dir:
        return Path(sft.cache_dir)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "decentrl"


def warmstart_key(model: ModelConfig, task: TaskConfig, sft: SFTConfig) -> str:
    # How the model is split into pipeline stages changes nothing of its weights: a staged run
    # starts from the same warm start as the unstaged one (the same key). The vision settings are
    # left out where they are off, so a text model's key does not depend on them.
    unstaged = model.model_copy(
        update={name: ModelConfig.model_fields[name].default for name in STAGING_FIELDS}
    )
    settings = {
        "format": WARMSTART_FORMAT,
        "model": unstaged.model_dump(exclude={"path"} | ({"vision"} if model.vision is None else set())),
        # how episodes are run (served or not) changes no demonstration: the same warm start
        "task": task.model_dump(exclude={"eval_size", "served", "max_env_retries", "max_env_failures"}),
        "sft": sft.model_dump(
            exclude={"cache_dir"}
            | ({"teacher_misread"} if not sft.teacher_misread else set())
            | ({"demonstrations"} if sft.demonstrations is None else set())
            | ({"train_vision_tower"} if model.vision is None else set())
        ),
    }
    if task.env == "dataset":  # the rows, not the path: a file edited in place trains anew
        from decentrl.envs.dataset import files_digest

        settings["data"] = files_digest(task.args)
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def cached_warm_start(model: ModelConfig, task: TaskConfig, sft: SFTConfig) -> Path | None:
    """The cached warm start's directory, or None when it must be trained."""
    target = cache_root(sft) / f"warmstart-{warmstart_key(model, task, sft)}"
    if (target / "model.safetensors").is_file():
        log.info("warm start: cached at %s", target)
        return target
    return None
