"""One model, one in-process vLLM engine and one vLLM server for the whole engine test session:
each costs seconds to minutes to start, so the tests share them (and leave them at version 0)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from vllm_support import VLLMServer

from decentrl.config import ModelConfig
from decentrl.model.tiny import build_tiny, save_model_dir

QWEN25_SAMPLING_DEFAULTS = {
    "do_sample": True,
    "repetition_penalty": 1.05,
    "temperature": 0.7,
    "top_k": 20,
    "top_p": 0.8,
}


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
    with torch.no_grad():  # weights exactly representable in bf16, as published; buffers (RoPE's
        for parameter in model.parameters():  # inv_freq) stay fp32, as in every engine
            parameter.copy_(parameter.to(torch.bfloat16))
    model = model.eval()
    model_dir = save_model_dir(model, tokenizer, tmp_path_factory.mktemp("bpe"))
    # The sampling defaults Qwen2.5-Instruct ships, which a server applies to any field a request
    # leaves out: every engine must sample from the plain softmax all the same.
    generation = json.loads((model_dir / "generation_config.json").read_text())
    generation.pop("_from_model_config")  # a checkpoint's own file, not one derived from config.json
    generation.update(QWEN25_SAMPLING_DEFAULTS)
    (model_dir / "generation_config.json").write_text(json.dumps(generation))
    return TestModel(model, tokenizer, model_dir)


def published(model) -> dict:
    """The state as a worker receives it: bf16, the tied output layer left out."""
    return {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if k != "lm_head.weight"}


ENGINE_DTYPES = [
    "float32",
    pytest.param(
        "bfloat16",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                not torch.cuda.is_available(), reason="the bfloat16 engine runs on a CUDA device"
            ),
        ],
    ),
]
"""The engine tests run in float32 everywhere (CPU, or CUDA where vLLM's CUDA build is installed)
and, marked `gpu`, in bfloat16 on CUDA: `pytest -m gpu tests/engines` on a GPU host."""


@pytest.fixture(scope="session")
def vllm_engines(bpe_model):
    """One engine per dtype for the session, each made when a test first asks for it."""
    from decentrl.engines.vllm import VLLMEngine

    engines = {}

    def get(dtype: str):
        if dtype not in engines:
            engines[dtype] = VLLMEngine(bpe_model.model_dir, dtype=dtype, seed=0)
            engines[dtype].load_weights(published(bpe_model.model), 0)
        return engines[dtype]

    return get


@pytest.fixture(scope="session")
def vllm_engine(vllm_engines):
    return vllm_engines("float32")


@pytest.fixture(scope="session")
def vllm_server(bpe_model):
    with VLLMServer(bpe_model.model_dir) as server:
        yield server
