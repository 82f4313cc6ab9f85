"""The embedded default model: a small Qwen2 (real `transformers` code) with a tokenizer made here.

`model.tokenizer` picks the character tokenizer (the demo) or a byte-level BPE trained on
generated text (model/bpe.py), which gives the model several EOS ids and a Qwen2.5 chat template:
the shape of a real checkpoint, at any size `model.*` asks for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from decentrl.config import ModelConfig
from decentrl.model.bpe import eos_token_ids, train_bpe_tokenizer
from decentrl.model.tokenizer import build_char_tokenizer

MIN_HEAD_SIZE = 32  # vLLM's CPU attention kernels support head sizes 32 to 512, not 16


def build_tokenizer(config: ModelConfig) -> PreTrainedTokenizerFast:
    if config.tokenizer == "bpe":
        return train_bpe_tokenizer(config.vocab_size, seed=config.seed)
    return build_char_tokenizer()


def tiny_config(config: ModelConfig, tokenizer: PreTrainedTokenizerFast) -> Qwen2Config:
    head_size, remainder = divmod(config.hidden_size, config.num_heads)
    if remainder or head_size < MIN_HEAD_SIZE:
        raise ValueError(
            f"model.hidden_size / model.num_heads must be an integer >= {MIN_HEAD_SIZE}, "
            f"got {config.hidden_size}/{config.num_heads}; raise hidden_size or lower num_heads"
        )
    # The BPE model lists both of its end tokens, as Qwen2.5's config does; the char model has one.
    # Both tokenizers built here define one eos and one pad token, so their ids are plain ints.
    eos = eos_token_ids(tokenizer) if config.tokenizer == "bpe" else cast(int, tokenizer.eos_token_id)
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=config.max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=cast(int, tokenizer.pad_token_id),
    )


def build_tiny(config: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A freshly initialised model and its tokenizer (deterministic in `config.seed`)."""
    tokenizer = build_tokenizer(config)
    torch.manual_seed(config.seed)
    model = Qwen2ForCausalLM(tiny_config(config, tokenizer))
    return model, tokenizer


def save_model_dir(model: PreTrainedModel, tokenizer: Any, path: Path) -> Path:
    """Write a self-contained HF directory (config, safetensors weights, tokenizer files; a
    processor writes its own settings and chat template beside its tokenizer's)."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
