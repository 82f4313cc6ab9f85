"""A model directory's end-of-sequence and padding ids and its context length, read from its JSON
files (no torch).

A checkpoint may list several EOS ids (Qwen2.5: `<|im_end|>` and `<|endoftext|>`; Llama-3
instruct: `<|end_of_text|>` in config.json and `<|eot_id|>` added in generation_config.json).
Generation stops at any of them, so every role reads the same union, `config.json`'s ids first.
The first id is not always the end-of-turn token the chat template writes (Llama-3.1:
`<|end_of_text|>`; Gemma: `<eos>`, not `<end_of_turn>`), so an environment turn drops the EOS the
model actually ended with (`ChatFormat.env_ids`).
"""

from __future__ import annotations

import json
from pathlib import Path


def as_ids(value: int | list[int] | None) -> list[int]:
    """An `eos_token_id` field (an int, a list of ints, or absent) as a list."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


TEXT_FIELDS = ("vocab_size", "eos_token_id", "pad_token_id", "max_position_embeddings")
"""What a vision-language model's config.json says in its `text_config` (LLaVA, Qwen2-VL)."""


def read_config(model_dir: Path) -> dict:
    """`config.json`, with a vision-language model's `text_config` fields (vocabulary, EOS, pad,
    context) lifted to the top where the top does not set them."""
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config")
    if isinstance(text, dict):
        config.update({key: text[key] for key in TEXT_FIELDS if config.get(key) is None and key in text})
    return config


def read_eos_token_ids(model_dir: Path) -> list[int]:
    """`config.json`'s EOS ids, then any more from `generation_config.json`; a ValueError naming
    the fix when there is none."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.is_file():
            config = read_config(model_dir) if name == "config.json" else json.loads(path.read_text())
            ids += [i for i in as_ids(config.get("eos_token_id")) if i not in ids]
    if not ids:
        raise ValueError(
            f"{model_dir}/config.json names no eos_token_id; set it (an id or a list) in config.json"
        )
    return ids


def read_pad_token_id(model_dir: Path) -> int:
    """`config.json`'s pad id, else the first EOS id (left padding is masked out anyway)."""
    pad = read_config(model_dir).get("pad_token_id")
    return int(pad) if pad is not None else read_eos_token_ids(model_dir)[0]


def read_max_context(model_dir: Path) -> int | None:
    """`config.json`'s `max_position_embeddings`: the tokens an episode may hold (None: not said)."""
    length = read_config(model_dir).get("max_position_embeddings")
    return int(length) if length else None
