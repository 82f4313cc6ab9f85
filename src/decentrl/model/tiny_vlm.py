"""The embedded vision-language model: LLaVA (real `transformers` code) built from a config here.

A CLIP vision tower cuts each image into patches and encodes them; a two-layer projector maps
each patch's feature to the width of the tiny Qwen2 of `model/tiny.py`, which reads them as
image tokens in place of the `<image>` tokens of its prompt (`LlavaForConditionalGeneration`).
The tokenizer is the character tokenizer plus `<image>`; the processor (`LlavaProcessor`) pairs it
with CLIP's PIL image processor (no torchvision) and a chat template that writes `<image>` where a
message's content list has an image. Nothing is downloaded: weights are random until the warm start.

Why LLaVA: every image takes the same number of tokens (the coordinator counts them without
`transformers`, `envs/image_tokens.py`), and the language model keeps its 1-D positions, so the
engines' left-padded, KV-cached sampling and the trainer's right-padded scoring are the text
model's own.
"""

from __future__ import annotations

import torch
from transformers import (
    CLIPVisionConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

from decentrl.config import ModelConfig
from decentrl.model.tiny import tiny_config
from decentrl.model.tokenizer import build_char_tokenizer

IMAGE_TOKEN = "<image>"
# The tiny template's "role: content" lines, with `<image>` for each image part of a content list.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}" + IMAGE_TOKEN + "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_vlm_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer with `<image>` as one more special token (the last id)."""
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return tokenizer


def build_processor(config: ModelConfig) -> LlavaProcessor:
    assert config.vision is not None, "a vision-language model needs [model.vision]"
    side = config.vision.image_size
    images = CLIPImageProcessorPil(
        size={"height": side, "width": side},
        crop_size={"height": side, "width": side},
        do_center_crop=False,
    )
    return LlavaProcessor(
        image_processor=images,
        tokenizer=build_vlm_tokenizer(),
        patch_size=config.vision.patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token, which the "default" strategy drops
        chat_template=VLM_CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
    )


def tiny_vlm_config(config: ModelConfig, processor: LlavaProcessor) -> LlavaConfig:
    vision = config.vision
    assert vision is not None, "a vision-language model needs [model.vision]"
    tokenizer = processor.tokenizer
    return LlavaConfig(
        text_config=tiny_config(config, tokenizer),
        vision_config=CLIPVisionConfig(
            hidden_size=vision.hidden_size,
            intermediate_size=vision.intermediate_size,
            num_hidden_layers=vision.num_layers,
            num_attention_heads=vision.num_heads,
            image_size=vision.image_size,
            patch_size=vision.patch_size,
            projection_dim=vision.hidden_size,
        ),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        image_seq_length=(vision.image_size // vision.patch_size) ** 2,
        tie_word_embeddings=True,
    )


def build_tiny_vlm(config: ModelConfig) -> tuple[LlavaForConditionalGeneration, LlavaProcessor]:
    """A freshly initialised LLaVA and its processor (deterministic in `config.seed`)."""
    processor = build_processor(config)
    torch.manual_seed(config.seed)
    return LlavaForConditionalGeneration(tiny_vlm_config(config, processor)), processor
