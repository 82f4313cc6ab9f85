"""Vision-language policies: which `transformers` class loads a model directory, and the pixel
inputs of its images.

Every role that runs the policy (the hf engine, the trainer, the verifier, evaluation, the warm
start) turns a rollout's images into pixel values here, with the model directory's own image
processor forced onto its PIL backend: a torchvision backend resizes with other kernels, and a
worker and a verifier that computed different pixels would disagree on every log-prob after the
image.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, PreTrainedModel

from decentrl.envs.images import TaskImage
from decentrl.protocol import RolloutImage

PIXEL_CACHE = 1024
"""Images whose pixel values a `PixelInputs` keeps (a group's rollouts share their prompt's)."""


def is_vision_language(config) -> bool:
    """A `transformers` config (or config.json as a dict) of a vision-language model."""
    if isinstance(config, dict):
        return config.get("vision_config") is not None
    return getattr(config, "vision_config", None) is not None


def policy_class(config):
    """The auto class that builds the policy of `config`: causal LM or image-text-to-text."""
    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def load_policy(model_dir: Path | str, dtype: torch.dtype) -> PreTrainedModel:
    """The model directory's policy with its weights."""
    return policy_class(AutoConfig.from_pretrained(model_dir)).from_pretrained(model_dir, dtype=dtype)


def policy_from_config(model_dir: Path | str, dtype: torch.dtype) -> PreTrainedModel:
    """The model directory's architecture with random weights (a published version follows)."""
    config = AutoConfig.from_pretrained(model_dir)
    return policy_class(config).from_config(config, dtype=dtype)


def move_vision(
    vision: dict[str, torch.Tensor] | None, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Pixel inputs on the model's device, floating tensors in its dtype (as keyword arguments)."""
    return {
        name: tensor.to(device, dtype) if tensor.is_floating_point() else tensor.to(device)
        for name, tensor in (vision or {}).items()
    }


class PixelInputs:
    """The pixel values of images, as the model directory's image processor makes them."""

    def __init__(self, image_processor):
        self.image_processor = image_processor
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()

    @classmethod
    def from_model_dir(cls, model_dir: Path | str) -> PixelInputs | None:
        """None for a text-only model (no vision config)."""
        model_dir = Path(model_dir)
        if not is_vision_language(json.loads((model_dir / "config.json").read_text())):
            return None
        from transformers import AutoImageProcessor

        return cls(AutoImageProcessor.from_pretrained(model_dir, backend="pil"))

    def _one(self, image: TaskImage) -> torch.Tensor:
        cached = self._cache.get(image.sha256)
        if cached is None:
            out = self.image_processor(images=[image.to_pil()], return_tensors="pt")
            cached = self._cache[image.sha256] = out["pixel_values"][0]
            while len(self._cache) > PIXEL_CACHE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(image.sha256)
        return cached

    def pixel_values(self, images: Sequence[TaskImage]) -> torch.Tensor:
        """[N, C, H, W] float32 for `images` in order."""
        return torch.stack([self._one(image) for image in images])

    def vision_inputs(self, rows: Sequence[Sequence[TaskImage]]) -> dict[str, torch.Tensor] | None:
        """The keyword arguments a forward over rows with these images takes (images of every row,
        row after row, as the image tokens come), or None when no row has an image."""
        images = [image for row in rows for image in row]
        return {"pixel_values": self.pixel_values(images)} if images else None


class ImagesDiffer(ValueError):
    """The images a task draws from its seed are not the ones a rollout names."""


def drawn_images(env, seed: int | None, named: Sequence[RolloutImage] | None) -> tuple[TaskImage, ...]:
    """The images a rollout names, drawn again from its task's seed (the trainer and the verifier
    never receive pixels); an ImagesDiffer when the drawing does not hash to the names, which the
    coordinator has already checked (a different environment version, say)."""
    if not named:
        return ()
    if seed is None:
        raise ImagesDiffer("a rollout with images came without its task's seed")
    drawn = env.problem(seed, "train").images
    if [image.sha256 for image in drawn] != [image.sha256 for image in named]:
        raise ImagesDiffer(
            f"seed {seed}: the environment here draws other images than the rollout names; "
            "run the coordinator's version of the environment"
        )
    return drawn
