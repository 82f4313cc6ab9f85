"""Several end-of-sequence ids: the hf engine stops at whichever comes first, and a model
directory's ids are read as the union of config.json and generation_config.json."""

from __future__ import annotations

import json

import pytest
import torch

from decentrl.config import ModelConfig
from decentrl.engines.hf import HFEngine
from decentrl.model.special import read_eos_token_ids, read_pad_token_id
from decentrl.model.tiny import build_tiny
from decentrl.protocol import SamplingParams


def test_generation_stops_at_any_of_several_eos_ids() -> None:
    torch.manual_seed(0)
    model, tokenizer = build_tiny(ModelConfig())
    prompts = [tokenizer.encode("12+34="), tokenizer.encode("7+8=")]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    never = len(tokenizer) - 1  # a character the greedy continuation below does not produce
    free = HFEngine(model, [never], tokenizer.pad_token_id, "cpu").generate(prompts, greedy)
    assert all(never not in c.token_ids and c.finish_reason == "length" for c in free)
    # Make the third greedy token of the first prompt an end-of-sequence id, listed second.
    stop = free[0].token_ids[2]
    stopped = HFEngine(model, [never, stop], tokenizer.pad_token_id, "cpu").generate(prompts, greedy)
    for before, after in zip(free, stopped, strict=True):
        if stop in before.token_ids:
            end = before.token_ids.index(stop) + 1
            assert after.token_ids == before.token_ids[:end] and after.finish_reason == "stop"
            assert after.logprobs == pytest.approx(before.logprobs[:end], abs=1e-6)
        else:
            assert after.token_ids == before.token_ids and after.finish_reason == "length"
    assert stopped[0].token_ids[-1] == stop and len(stopped[0].token_ids) <= 3


def test_eos_ids_are_the_union_of_config_and_generation_config(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 128001}))
    assert read_eos_token_ids(tmp_path) == [128001]
    assert read_pad_token_id(tmp_path) == 128001  # no pad id: the first EOS id
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    assert read_eos_token_ids(tmp_path) == [128001, 128009]  # Llama-3 instruct's layout
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 0], "pad_token_id": 0}))
    (tmp_path / "generation_config.json").unlink()
    assert read_eos_token_ids(tmp_path) == [2, 0] and read_pad_token_id(tmp_path) == 0
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="names no eos_token_id; set it"):
        read_eos_token_ids(tmp_path)


def test_the_prompt_pass_keeps_only_the_last_positions_logits() -> None:
    """The prefill's logits are batch x 1 x vocabulary: the whole prompt's would hold GBs for a
    benchmark batch on a real vocabulary, and generation reads only the last row. Tokens and
    log-probs are those of a full-logits pass."""
    torch.manual_seed(0)
    model, tokenizer = build_tiny(ModelConfig())
    prompts = [tokenizer.encode("12+34="), tokenizer.encode("7+8=")]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    engine = HFEngine(model, [len(tokenizer) - 1], tokenizer.pad_token_id, "cpu")
    shapes = []
    forward = model.forward

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        shapes.append(tuple(out.logits.shape))
        return out

    model.forward = recording
    completions = engine.generate(prompts, greedy)
    assert shapes[0] == (2, 1, len(tokenizer)), shapes[0]
    model.forward = forward
    ids = torch.tensor([prompts[0] + completions[0].token_ids[:-1]])
    full = torch.log_softmax(model(input_ids=ids).logits[0, len(prompts[0]) - 1 :].float(), -1)
    expected = full.gather(-1, torch.tensor(completions[0].token_ids)[:, None]).squeeze(-1)
    assert completions[0].token_ids == full.argmax(-1).tolist()
    assert completions[0].logprobs == pytest.approx(expected.tolist(), abs=1e-5)
