"""`[worker] engine` picks the engine; a missing piece is one line naming the fix."""

from __future__ import annotations

import importlib.util

import pytest

from decentrl.config import ConfigError, ModelConfig, WorkerConfig, load_config
from decentrl.engines.base import EngineUnavailable, group_runs, request_seed
from decentrl.engines.registry import ENGINES, declared_precision
from decentrl.model.tiny import build_tiny, save_model_dir


def test_every_configurable_engine_has_a_builder():
    names = set(WorkerConfig.model_fields["engine"].annotation.__args__)
    assert names == set(ENGINES) == {"hf", "vllm", "openai"}


def test_an_unknown_engine_is_a_config_error():
    with pytest.raises(ConfigError, match="worker.engine"):
        load_config(None, ['worker.engine="sglang"'])


@pytest.mark.parametrize(("dtype", "built"), [("auto", "float32"), ("bfloat16", "bfloat16")])
def test_the_hf_engine_computes_in_worker_dtype_and_declares_it(tmp_path, dtype, built):
    model_dir = save_model_dir(*build_tiny(ModelConfig()), tmp_path)
    config = WorkerConfig(engine="hf", dtype=dtype, device="cpu")
    engine = ENGINES["hf"](config, model_dir, tmp_path)
    assert {str(p.dtype) for p in engine.model.parameters()} == {f"torch.{built}"}
    assert declared_precision(config) == (built, "cpu")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_without_vllm_names_the_install(tmp_path):
    model_dir = save_model_dir(*build_tiny(ModelConfig()), tmp_path)
    with pytest.raises(EngineUnavailable, match="make vllm-venv"):
        ENGINES["vllm"](WorkerConfig(engine="vllm"), model_dir, tmp_path)


def test_openai_without_a_url_names_the_setting(tmp_path):
    with pytest.raises(EngineUnavailable, match="worker.openai_url"):
        ENGINES["openai"](WorkerConfig(engine="openai"), tmp_path, tmp_path)


def test_openai_without_a_server_names_the_problem(tmp_path):
    model_dir = save_model_dir(*build_tiny(ModelConfig()), tmp_path / "model")
    config = WorkerConfig(engine="openai", openai_url="http://127.0.0.1:9")  # discard port: refused
    with pytest.raises(EngineUnavailable, match="no OpenAI-compatible server answers"):
        ENGINES["openai"](config, model_dir, tmp_path)


def test_identical_consecutive_prompts_share_a_request_with_distinct_seeds():
    assert group_runs([[1, 2], [1, 2], [3], [1, 2]]) == [([1, 2], 2), ([3], 1), ([1, 2], 1)]
    seeds = [request_seed(7, index) for index in range(3)]
    # request i's n samples use seeds seed_i .. seed_i + n - 1: they never meet the next request's
    assert all(b - a == 1 << 16 for a, b in zip(seeds, seeds[1:], strict=False))
