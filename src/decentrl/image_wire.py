"""Images on the wire: how a rollout names the images its image tokens stand for (docs/protocol.md).

A rollout never carries a task's pixels: every role draws them from the task's seed and the
coordinator compares hashes (`coordinator/pipeline/image_binding.py`). Only an image a served
environment produced during the episode would travel, with its env server's signature. Imports
neither torch nor any role.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Wire(BaseModel):
    # as protocol.Wire (defined there; this module sits below it)
    model_config = ConfigDict(extra="forbid", frozen=False, strict=True)


MAX_ROLLOUT_IMAGES = 64
"""Schema ceiling on a rollout's images; `coordinator.max_images_per_rollout` is the run's limit."""


class RolloutImage(_Wire):
    """One image a rollout's image tokens stand for, named by the hash of its pixels
    (`envs/images.py`), in the order of the image tokens (docs/protocol.md, "Images")."""

    sha256: str = Field(..., pattern=r"^[0-9a-f]{64}$")
    source: Literal["task", "env"] = "task"
    """"task": drawn by the environment from the task's seed, which the coordinator draws again and
    compares; "env": produced during the episode by a served environment, which must sign it."""
    png: str | None = Field(default=None, max_length=1 << 24)
    """An "env" image's PNG, base64 (its size is bounded by `coordinator.max_image_bytes`)."""
    signature: str | None = Field(default=None, pattern=r"^[0-9a-f]{128}$")
    """An "env" image's signature by the env server that produced it."""
