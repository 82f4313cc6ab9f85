"""A rollout's images, checked before anything costly: bounds, binding to the task, positions.

A vision-language rollout names its images by the hash of their pixels (`RolloutImage`). A task's
images are never sent: the environment draws them from the task's seed, here as on the worker,
so each named hash must be the hash of the image the task drew, in order (a swapped image, one
from another task or one the task never drew is refused). The image tokens stand where the
processor put them: in the prompt, which is compared id for id with the task's already, one run
per image; a model or environment segment holding an image token is refused, since only a
processor places them and the engines never sample one. Images that a served environment
produced during an episode would arrive encoded and signed by their env server: their size is
bounded here first (bytes, then the pixels the PNG header declares, before any decoder runs),
and, with no env server trusted by this coordinator, they are then refused.
Each refusal is one 4xx: ingestion stores nothing of the submission.
"""

from __future__ import annotations

import base64
import binascii
import sqlite3

from decentrl.coordinator.context import Context
from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.envs.image_tokens import ImageTokensError
from decentrl.envs.images import TaskImage, png_size
from decentrl.protocol import Rollout, RolloutImage


def _env_image_pixels(index: int, image: RolloutImage) -> tuple[int, int]:
    """(bytes, pixels) of an image a served environment produced, from its PNG header only."""
    try:
        data = base64.b64decode(image.png or "", validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(422, f"images[{index}]: png is not base64", Reason.IMAGE) from None
    size = png_size(data)
    if size is None:
        raise ApiError(422, f"images[{index}]: an env image needs its PNG", Reason.IMAGE)
    return len(data), size[0] * size[1]


def _check_bounds(context: Context, rollout: Rollout, task_images: tuple[TaskImage, ...]) -> None:
    config = context.config
    images = rollout.images or []
    if len(images) > config.max_images_per_rollout:
        detail = (
            f"{len(images)} images, over coordinator.max_images_per_rollout={config.max_images_per_rollout}"
        )
        raise ApiError(413, detail, Reason.OVERSIZED)
    sent_bytes, pixels = 0, sum(image.num_pixels for image in task_images)
    for index, image in enumerate(images):
        if image.source == "env":
            size, area = _env_image_pixels(index, image)
            sent_bytes, pixels = sent_bytes + size, pixels + area
        elif image.png is not None or image.signature is not None:
            detail = f"images[{index}]: a task's image is named by its hash, never sent"
            raise ApiError(422, detail, Reason.IMAGE)
    if sent_bytes > config.max_image_bytes:
        detail = f"images take {sent_bytes} bytes, over coordinator.max_image_bytes={config.max_image_bytes}"
        raise ApiError(413, detail, Reason.OVERSIZED)
    if pixels > config.max_image_pixels:
        detail = f"images hold {pixels} pixels, over coordinator.max_image_pixels={config.max_image_pixels}"
        raise ApiError(413, detail, Reason.OVERSIZED)


def _check_binding(rollout: Rollout, task_images: tuple[TaskImage, ...]) -> None:
    named = [image for image in rollout.images or [] if image.source == "task"]
    if len(named) != len(task_images):
        detail = f"the rollout names {len(named)} task images; its task drew {len(task_images)}"
        raise ApiError(422, detail, Reason.IMAGE_MISMATCH)
    for index, (image, drawn) in enumerate(zip(named, task_images, strict=True)):
        if image.sha256 != drawn.sha256:
            detail = f"images[{index}] is not the image task {rollout.task_id!r} drew (sha256 differs)"
            raise ApiError(422, detail, Reason.IMAGE_MISMATCH)
    if any(image.source == "env" for image in rollout.images or []):
        # The hook for served environments: an image produced during the episode is accepted only
        # under the signature of an env server this coordinator trusts, and it trusts none.
        detail = "an image produced by the worker's environment needs its env server's signature; none is trusted here"
        raise ApiError(422, detail, Reason.IMAGE_UNSIGNED)


def _check_positions(context: Context, rollout: Rollout, num_images: int) -> None:
    tokens = context.model.image_tokens
    assert tokens is not None, "a text-only run has no image tokens"
    try:
        in_prompt = tokens.count(rollout.prompt_token_ids)
    except ImageTokensError as exc:
        raise ApiError(422, f"prompt: {exc}", Reason.IMAGE_TOKENS) from None
    if in_prompt != num_images:
        detail = f"the prompt holds the tokens of {in_prompt} images, the task has {num_images}"
        raise ApiError(422, detail, Reason.IMAGE_TOKENS)
    for index, segment in enumerate(rollout.segments):
        if tokens.token_id in segment.token_ids:
            detail = f"segments[{index}] holds image token {tokens.token_id}: only the processor places them"
            raise ApiError(422, detail, Reason.IMAGE_TOKENS)


def check_images(context: Context, rollout: Rollout, task: sqlite3.Row) -> None:
    """Refuse a rollout whose images exceed the run's limits, differ from its task's, or whose
    image tokens are not where the task's images go. A text run refuses any image."""
    if context.model.image_tokens is None:
        if rollout.images:
            raise ApiError(422, "this run's policy is text-only: a rollout has no images", Reason.IMAGE)
        return
    # The task's images, drawn again from its seed (cheap: a few thousand pixels, pure Python).
    task_images = context.env.problem(task["seed"], "train").images
    _check_bounds(context, rollout, task_images)
    _check_positions(context, rollout, len(task_images))
    _check_binding(rollout, task_images)
