"""The vllm engine against the trainer's own log-prob code on the same weights (real vLLM)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import ENGINE_DTYPES, published
from vllm_support import require_vllm

from decentrl.algo.logprobs import sequence_logprobs
from decentrl.engines.base import EngineUnavailable
from decentrl.engines.vllm import VLLMEngine
from decentrl.protocol import SamplingParams
from decentrl.trust.logprob_tolerance import CALIBRATED

require_vllm()

pytestmark = pytest.mark.vllm


@pytest.fixture(params=ENGINE_DTYPES)
def setup(request, bpe_model, vllm_engines):
    engine = vllm_engines(request.param)
    prompts = [bpe_model.tokenizer(text)["input_ids"] for text in ["12+35=", "7+8=", "99+1="]]
    yield bpe_model.model, engine, prompts
    engine.load_weights(published(bpe_model.model), 0)  # the next test starts from version 0


def trainer_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logprobs, _ = sequence_logprobs(model, ids, torch.ones_like(ids), temperature)
    return logprobs[0, len(prompt) :].tolist()


def gaps(model, prompts, completions, temperature: float) -> list[float]:
    return [
        abs(a - b)
        for prompt, c in zip(prompts, completions, strict=True)
        for a, b in zip(c.logprobs, trainer_logprobs(model, prompt, c.token_ids, temperature), strict=True)
    ]


def max_gap(model, prompts, completions, temperature: float) -> float:
    return max(gaps(model, prompts, completions, temperature))


def agrees_with_trainer(engine, model, prompts, completions, temperature: float) -> bool:
    """fp32: vLLM's kernels and transformers' agree to ~1e-6 per token. bf16: within the
    verifier's calibrated bfloat16 tolerance (trust/logprob_tolerance.py), which this checks on the GPU."""
    found = gaps(model, prompts, completions, temperature)
    if engine.dtype_name == "float32":
        return max(found) < 1e-4
    tolerance = CALIBRATED["*/bfloat16"]
    return max(found) < tolerance.max and sum(found) / len(found) < tolerance.mean


def test_logprobs_are_the_trainers_temperature_scaled_ones(setup):
    model, engine, prompts = setup
    batch = [p for p in prompts for _ in range(4)]
    completions = engine.generate(batch, SamplingParams(temperature=0.7, max_new_tokens=6), seed=1)
    assert len(completions) == len(batch)
    assert agrees_with_trainer(engine, model, batch, completions, 0.7)
    # The raw (unscaled) log-probs are not what the engine reports: this pins the definition.
    assert max_gap(model, batch, completions, 1.0) > 1e-2
    assert all(set(c.policy_versions) == {0} for c in completions)


def test_greedy_logprobs_are_unscaled(setup):
    model, engine, prompts = setup
    completions = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6), seed=1)
    assert agrees_with_trainer(engine, model, prompts, completions, 0.0)


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
    original, engine, prompts = setup
    model = copy.deepcopy(original)
    torch.manual_seed(0)
    changed = {
        name: (model.state_dict()[name] + 0.2 * torch.randn_like(model.state_dict()[name])).to(torch.bfloat16)
        for name in [
            "model.layers.0.self_attn.q_proj.weight",  # fused with k and v in vLLM
            "model.layers.1.mlp.up_proj.weight",  # fused with gate
            "model.embed_tokens.weight",  # tied to the output layer
        ]
    }
    before = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6), seed=1)
    engine.update_weights(changed, 1)
    model.load_state_dict({name: tensor.float() for name, tensor in changed.items()}, strict=False)
    after = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6), seed=1)
    # k/v and gate of the fused layers survived, the output layer follows the embedding: the whole
    # model matches the trainer's.
    assert agrees_with_trainer(engine, model, prompts, after, 0.0)
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


def test_a_head_size_the_cpu_backend_lacks_is_a_clear_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the head-size limit is the CPU backend's")
    config = {"num_attention_heads": 4, "hidden_size": 64, "eos_token_id": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineUnavailable, match="head sizes"):
        VLLMEngine(tmp_path)


def test_the_trainers_mismatch_kl_shows_the_bf16_engine_gap(bpe_model, vllm_engines):
    """The trainer's per-step `mismatch_kl` (its k3 KL between the behaviour log-probs and its own,
    `algo/corrections`) on batches sampled by vLLM in fp32 and in bf16 (on CPU here): the bf16
    engine's numeric gap shows, orders of magnitude above fp32's."""
    from benchmarks.engines import engine_gap

    prompts = [
        bpe_model.tokenizer(text)["input_ids"] for text in ["12+35=", "7+8=", "99+1="] for _ in range(8)
    ]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16)
    kl = {}
    for dtype in ("float32", "bfloat16"):
        completions = vllm_engines(dtype).generate(prompts, sampling, seed=3)
        kl[dtype], largest, _ = engine_gap(bpe_model.model, prompts, completions)
        assert largest < CALIBRATED[f"*/{dtype}"].max
    assert kl["bfloat16"] > 100 * max(kl["float32"], 1e-12), kl


def test_lora_adapters_are_served_unmerged_and_follow_each_version(bpe_model):
    """A LoRA run: vLLM starts from the base with LoRA enabled, and each version's adapters (a
    delta carries only the B that changed) compute what the trainer's adapted model computes."""
    from decentrl.config import LoraConfig
    from decentrl.model import adapters, lora

    trainer = lora.attach(copy.deepcopy(bpe_model.model), LoraConfig(rank=2, alpha=32.0))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in trainer.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.005 * torch.randn(parameter.shape, generator=generator))
    state = {name: tensor.to(torch.bfloat16) for name, tensor in lora.publication_state(trainer).items()}
    served = copy.deepcopy(bpe_model.model)  # the published adapters, unmerged, in fp32
    adapters.serve(served, state)
    served.load_state_dict(state, strict=False)
    engine = VLLMEngine(bpe_model.model_dir, dtype="float32", seed=0)
    engine.load_weights(state, 0)
    prompts = [bpe_model.tokenizer(text)["input_ids"] for text in ["12+35=", "7+8=", "99+1="]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    first = engine.generate(prompts, greedy, seed=1)
    assert max_gap(served, prompts, first, 0.0) < 1e-4
    assert max_gap(bpe_model.model, prompts, first, 0.0) > 1e-3  # the adapters matter: the check has teeth
    delta = {name: 2 * tensor for name, tensor in state.items() if name.endswith(".lora_B")}
    engine.update_weights(delta, 1)
    served.load_state_dict(delta, strict=False)
    second = engine.generate(prompts, greedy, seed=1)
    assert max_gap(served, prompts, second, 0.0) < 1e-4
    assert all(set(c.policy_versions) == {1} for c in second)
    engine.update_weights(
        {name: state[name] for name in state if ".lora_" not in name}, 2
    )  # a snapshot's base
    with pytest.raises(ValueError, match="base weights of a LoRA run changed"):
        engine.update_weights({"model.norm.weight": 2 * state["model.norm.weight"]}, 3)
    assert engine.policy_version == 2
