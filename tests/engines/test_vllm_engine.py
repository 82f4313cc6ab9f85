"""The vllm engine against the trainer's own log-prob code on the same weights (real vLLM)."""

from __future__ import annotations

import json

import pytest
import torch
from vllm_support import require_vllm

from decentrl.algo.logprobs import sequence_logprobs
from decentrl.config import ModelConfig
from decentrl.engines.base import EngineUnavailable, group_runs
from decentrl.engines.vllm import VLLMEngine
from decentrl.model.tiny import build_tiny, save_model_dir
from decentrl.protocol import SamplingParams

require_vllm()

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model, tokenizer = build_tiny(ModelConfig(seed=3))
    model_dir = save_model_dir(model, tokenizer, tmp_path_factory.mktemp("model"))
    engine = VLLMEngine(model_dir, dtype="float32", seed=0)
    engine.load_weights(model.state_dict(), 0)
    prompts = [tokenizer(text)["input_ids"] for text in ["12+35=", "7+8=", "99+1="]]
    return model.eval(), engine, prompts


def trainer_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logprobs, _ = sequence_logprobs(model, ids, torch.ones_like(ids), temperature)
    return logprobs[0, len(prompt) :].tolist()


def max_gap(model, prompts, completions, temperature: float) -> float:
    gaps = [
        abs(a - b)
        for prompt, c in zip(prompts, completions, strict=True)
        for a, b in zip(c.logprobs, trainer_logprobs(model, prompt, c.token_ids, temperature), strict=True)
    ]
    return max(gaps)


def test_logprobs_are_the_trainers_temperature_scaled_ones(setup):
    model, engine, prompts = setup
    batch = [p for p in prompts for _ in range(4)]
    completions = engine.generate(batch, SamplingParams(temperature=0.7, max_new_tokens=6), seed=1)
    assert len(completions) == len(batch)
    # fp32 on CPU: vLLM's kernels and transformers' agree to ~1e-6 per token.
    assert max_gap(model, batch, completions, 0.7) < 1e-4
    # The raw (unscaled) log-probs are not what the engine reports: this pins the definition.
    assert max_gap(model, batch, completions, 1.0) > 1e-2
    assert all(set(c.policy_versions) == {0} for c in completions)


def test_greedy_logprobs_are_unscaled(setup):
    model, engine, prompts = setup
    completions = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6), seed=1)
    assert max_gap(model, prompts, completions, 0.0) < 1e-4


def test_samples_differ_within_a_request_and_repeat_with_the_seed(setup):
    _, engine, prompts = setup
    batch = [prompts[0]] * 6 + [prompts[1]] * 6
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    first = engine.generate(batch, sampling, seed=5)
    again = engine.generate(batch, sampling, seed=5)
    other = engine.generate(batch, sampling, seed=6)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]
    assert len({tuple(c.token_ids) for c in first[:6]}) > 1, "the n samples of one prompt must differ"
    for c in first:
        assert (c.finish_reason == "stop") == (c.token_ids[-1] in engine.eos_token_ids)


def test_a_delta_reloads_only_its_tensors_in_place(setup):
    model, engine, prompts = setup
    torch.manual_seed(0)
    changed = {
        name: model.state_dict()[name] + 0.2 * torch.randn_like(model.state_dict()[name])
        for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    }
    before = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6), seed=1)
    engine.update_weights(changed, 1)
    model.load_state_dict(changed, strict=False)
    after = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6), seed=1)
    # k/v and gate of the same fused layers must have survived: the whole model matches the trainer.
    assert max_gap(model, prompts, after, 0.0) < 1e-4
    assert [c.logprobs for c in before] != [c.logprobs for c in after]
    assert all(set(c.policy_versions) == {1} for c in after)


def test_a_bad_tensor_is_refused_before_it_reaches_vllm(setup):
    model, engine, prompts = setup
    with pytest.raises(ValueError, match="unexpected"):
        engine.update_weights({"model.layers.9.nothing": torch.zeros(2)}, 7)
    with pytest.raises(ValueError, match="wrong shape"):
        engine.update_weights({"model.norm.weight": torch.zeros(3)}, 7)
    assert engine.policy_version != 7
    assert engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=2), seed=0)


def test_a_head_size_the_cpu_backend_lacks_is_a_clear_error(setup, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the head-size limit is the CPU backend's")
    config = {"num_attention_heads": 4, "hidden_size": 64, "eos_token_id": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineUnavailable, match="head sizes"):
        VLLMEngine(tmp_path)


def test_group_runs():
    assert group_runs([[1], [1], [2], [1]]) == [([1], 2), ([2], 1), ([1], 1)]
