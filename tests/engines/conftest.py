"""One model, one in-process vLLM engine and one vLLM server for the whole engine test session:
each costs seconds to minutes to start, so the tests share them (and leave them at version 0)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from vllm_support import VLLMServer

from decentrl.config import ModelConfig
from decentrl.model.tiny import build_tiny, save_model_dir


@dataclass
class TestModel:
    model: object
    tokenizer: object
    model_dir: Path


@pytest.fixture(scope="session")
def bpe_model(tmp_path_factory) -> TestModel:
    """The small Qwen2 on the byte-level BPE tokenizer (head size 32, random weights; 1024
    positions: the tool-use prompt alone, tools in the system turn, is ~300 tokens)."""
    model, tokenizer = build_tiny(ModelConfig(tokenizer="bpe", seed=3, max_positions=1024))
    model = model.to(torch.bfloat16).float().eval()  # weights exactly representable in bf16, as published
    return TestModel(model, tokenizer, save_model_dir(model, tokenizer, tmp_path_factory.mktemp("bpe")))


def published(model) -> dict:
    """The state as a worker receives it: bf16, the tied output layer left out."""
    return {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if k != "lm_head.weight"}


@pytest.fixture(scope="session")
def vllm_engine(bpe_model):
    from decentrl.engines.vllm import VLLMEngine

    engine = VLLMEngine(bpe_model.model_dir, dtype="float32", seed=0)
    engine.load_weights(published(bpe_model.model), 0)
    return engine


@pytest.fixture(scope="session")
def vllm_server(bpe_model):
    with VLLMServer(bpe_model.model_dir) as server:
        yield server
