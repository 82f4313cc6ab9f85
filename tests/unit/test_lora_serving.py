"""LoRA adapters served unmerged: a plain model takes the published layout as it is and computes
what the trainer's `peft` model computes, and a bf16 engine keeps a small-lr update that merging
into bf16 weights rounds away."""

from __future__ import annotations

import pytest
import torch

from benchmarks.lora import update_errors
from decentrl.config import ModelConfig
from decentrl.engines.hf import HFEngine
from decentrl.model import adapters, lora
from decentrl.model.tiny import build_tiny
from decentrl.protocol import SamplingParams
from decentrl.weights.codec import published_state


def served_logits(state: dict[str, torch.Tensor], ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    model, tokenizer = build_tiny(ModelConfig(seed=7))  # other random weights: all must be overwritten
    engine = HFEngine(model.to(dtype), [tokenizer.eos_token_id], tokenizer.pad_token_id, device="cpu")
    engine.load_weights(state, 0)
    assert set(engine.model.state_dict()) - set(state) == {"lm_head.weight"}  # the published layout
    return engine.model(input_ids=ids).logits.float()


def test_served_adapters_compute_what_the_peft_model_computes(adapted) -> None:
    ids = torch.randint(3, 98, (2, 9), generator=torch.Generator().manual_seed(1))
    state = lora.publication_state(adapted)
    with torch.no_grad():
        expected = adapted(input_ids=ids).logits
        exact = served_logits(state, ids, torch.float32)
        bf16 = served_logits(published_state(state, "bfloat16"), ids, torch.bfloat16)
    torch.testing.assert_close(exact, expected, atol=1e-5, rtol=1e-5)
    assert (bf16 - expected).abs().max() < 0.05  # bf16 rounding only


def test_a_delta_of_adapter_tensors_updates_the_served_layer_in_place(adapted) -> None:
    model, tokenizer = build_tiny(ModelConfig(seed=7))
    engine = HFEngine(
        model.to(torch.bfloat16), [tokenizer.eos_token_id], tokenizer.pad_token_id, device="cpu"
    )
    state = published_state(lora.publication_state(adapted), "bfloat16")
    engine.load_weights(state, 0)
    layer = engine.model.get_submodule("model.layers.1.mlp.up_proj")
    assert isinstance(layer, adapters.AdaptedLinear) and layer.lora_A.dtype == torch.bfloat16
    storage = layer.lora_B.data_ptr()
    new_b = 2 * state["model.layers.1.mlp.up_proj.lora_B"]
    engine.update_weights({"model.layers.1.mlp.up_proj.lora_B": new_b}, 1)
    assert layer.lora_B.data_ptr() == storage and torch.equal(layer.lora_B, new_b)
    completion = engine.generate([[4, 5, 6]], SamplingParams(max_new_tokens=3), seed=0)[0]
    assert set(completion.policy_versions) == {1}
    with pytest.raises(ValueError, match="model.layers.9.mlp.up_proj.lora_A names no layer"):
        engine.update_weights({"model.layers.9.mlp.up_proj.lora_A": torch.zeros(2, 128)}, 2)
    with pytest.raises(ValueError, match="served on torch.nn.Linear layers, not Qwen2RMSNorm"):
        engine.update_weights({"model.norm.lora_A": torch.zeros(2, 128)}, 2)
    assert engine.policy_version == 1


def test_update_error_is_the_fraction_of_the_update_a_served_model_misses() -> None:
    start = {"w": torch.zeros(4)}
    trainer = {"w": torch.tensor([1.0, 1.0, 1.0, 1.0])}
    assert adapters.update_error(trainer, start, trainer, start) == 0
    assert adapters.update_error(trainer, start, start, start) == 1  # still at the start
    half = {"w": torch.tensor([0.5, 0.5, 0.5, 0.5])}
    assert adapters.update_error(trainer, start, half, start) == pytest.approx(0.5)


def test_a_bf16_engine_serving_adapters_keeps_a_small_lr_update_that_merging_loses() -> None:
    errors = update_errors(lr=1e-5, versions=3)
    assert [e.version for e in errors] == [1, 2, 3]
    # bf16 A and B carry the update to a few tenths of a percent ...
    assert all(e.unmerged < 0.01 for e in errors), errors
    # ... while W0 + B A rounded to bf16 stays mostly at W0: the measurement has teeth
    assert all(e.merged > 0.3 and e.merged_changed < 0.9 for e in errors), errors
