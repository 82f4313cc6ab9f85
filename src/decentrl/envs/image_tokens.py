"""Where a vision-language model's images sit among the token ids, read from its directory (no torch).

A chat template writes one image token (`<image>`) where an image goes; the model's processor
replaces it by as many image tokens as the vision tower gives features for that image, and the
model puts one feature at each of those positions. The coordinator builds prompts without
`transformers`, so the expansion is done here from the processor's own config; the number per
image follows the processor (`tests/unit/test_image_tokens.py` checks it, id for id, against
`LlavaProcessor`). Image tokens are context: they count against the model's context and the
token budget like any prompt token and never enter the loss.

Supported processors: LLaVA's (`LlavaProcessor`): every image is resized to the processor's size
(or cropped to its crop size), so each takes (height / patch) x (width / patch) tokens, plus the
vision tower's extra tokens, minus the class token that the "default" feature strategy drops.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
"""A vision-language model's processor settings (the image processor's may sit in either file)."""
SUPPORTED_PROCESSORS = ("LlavaProcessor",)
VISION_ARCHITECTURES = ("LlavaForConditionalGeneration",)
"""Vision-language architectures decentrl runs end to end (docs/trainer.md)."""


class ImageTokensError(ValueError):
    """The image tokens of a sequence do not fit its images."""


@dataclass(frozen=True)
class ImageTokens:
    token: str
    """The placeholder a chat template writes, one per image."""
    token_id: int
    per_image: int
    """Tokens each image takes after expansion (the vision tower's features of one image)."""

    def expand(self, ids: Sequence[int]) -> list[int]:
        """`ids` with each image token repeated `per_image` times (what the processor does to text)."""
        out: list[int] = []
        for token in ids:
            out += [token] * self.per_image if token == self.token_id else [token]
        return out

    def count(self, ids: Sequence[int]) -> int:
        """How many images an expanded sequence holds; an ImageTokensError when its image tokens do
        not come in whole runs of `per_image`."""
        total, run = 0, 0
        for token in [*ids, -1]:
            if token == self.token_id:
                run += 1
                continue
            if run % self.per_image:
                raise ImageTokensError(f"a run of {run} image tokens where each image takes {self.per_image}")
            total += run // self.per_image
            run = 0
        return total

    def positions(self, ids: Sequence[int]) -> list[int]:
        """Indices of the image tokens in `ids`."""
        return [index for index, token in enumerate(ids) if token == self.token_id]


def _image_processor(model_dir: Path) -> tuple[dict, dict] | None:
    """(processor settings, image processor settings) of a model directory, or None."""
    path = model_dir / "processor_config.json"
    if not path.is_file():
        return None
    processor = json.loads(path.read_text())
    image = processor.get("image_processor")
    if image is None and (model_dir / "preprocessor_config.json").is_file():
        image = json.loads((model_dir / "preprocessor_config.json").read_text())
    return processor, image or {}


def _resized(image: dict) -> tuple[int, int]:
    size = image.get("crop_size") if image.get("do_center_crop") else image.get("size")
    if not isinstance(size, dict) or "height" not in size or "width" not in size:
        raise ValueError(
            f"image processor size {size!r}: only a fixed height and width are supported "
            "(every image then takes the same number of tokens)"
        )
    return int(size["height"]), int(size["width"])


def read_image_tokens(model_dir: Path) -> ImageTokens | None:
    """The image tokens of a vision-language model directory; None for a text-only model. A
    processor this module cannot count for is a ValueError naming what is supported."""
    found = _image_processor(model_dir)
    if found is None:
        return None
    processor, image = found
    kind = processor.get("processor_class")
    if kind not in SUPPORTED_PROCESSORS:
        raise ValueError(
            f"{model_dir}: processor {kind!r} is not supported; decentrl counts image tokens for "
            f"{', '.join(SUPPORTED_PROCESSORS)}"
        )
    config = json.loads((model_dir / "config.json").read_text())
    token_id = config.get("image_token_id", config.get("image_token_index"))
    if token_id is None:
        raise ValueError(f"{model_dir}/config.json names no image_token_id")
    height, width = _resized(image)
    patch = int(processor["patch_size"])
    per_image = (height // patch) * (width // patch) + int(processor.get("num_additional_image_tokens", 0))
    if processor.get("vision_feature_select_strategy") == "default":
        per_image -= 1  # the class token's feature is dropped
    return ImageTokens(str(processor.get("image_token", "<image>")), int(token_id), per_image)
