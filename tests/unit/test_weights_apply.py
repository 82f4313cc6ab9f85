"""A delta lands in the engine's live parameters in place, and the version switches with it."""

from __future__ import annotations

import pytest
import torch

from decentrl.config import ModelConfig
from decentrl.engines.hf import HFEngine
from decentrl.model.tiny import build_tiny
from decentrl.protocol import SamplingParams
from decentrl.weights.codec import decode_state, encode_state, published_state, state_hash
from decentrl.weights.unique_storage import state_for_publication


def test_delta_applies_in_place_to_the_live_engine() -> None:
    model, _ = build_tiny(ModelConfig(hidden_size=64, num_heads=2, intermediate_size=64, num_layers=1))
    engine = HFEngine(model, eos_token_ids=[1], pad_token_id=0, device="cpu")
    v0 = published_state(state_for_publication(model), "bfloat16")
    engine.load_weights(v0, 0)
    live_before = {name: tensor.data_ptr() for name, tensor in engine.model.state_dict().items()}
    v1 = {name: tensor.clone() for name, tensor in v0.items()}
    v1["model.embed_tokens.weight"][3] += 0.5  # one row moves (tied with lm_head)
    entries, payload = encode_state(v0, v1)
    mirror = {name: tensor.clone() for name, tensor in v0.items()}
    changed = decode_state(entries, payload, mirror)
    assert changed == ["model.embed_tokens.weight"] and state_hash(mirror) == state_hash(v1)
    engine.update_weights({name: mirror[name] for name in changed}, 1)
    live = engine.model.state_dict()
    assert {name: tensor.data_ptr() for name, tensor in live.items()} == live_before  # same storage
    assert torch.equal(live["model.embed_tokens.weight"].to(torch.bfloat16), v1["model.embed_tokens.weight"])
    assert torch.equal(live["lm_head.weight"], live["model.embed_tokens.weight"])  # still tied
    completion = engine.generate([[4, 5, 6]], SamplingParams(temperature=1.0, max_new_tokens=3), seed=0)[0]
    assert set(completion.policy_versions) == {1}
    with pytest.raises(ValueError, match="unexpected"):
        engine.update_weights({"no.such.weight": torch.zeros(1)}, 2)
    assert engine.policy_version == 1
