"""The byte-level BPE tokenizer trained here and the Qwen2 model built around it."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from decentrl.config import ModelConfig
from decentrl.envs.chat import ChatFormat
from decentrl.model.bpe import ENDOFTEXT, IM_END, IM_START, TAG_TOKENS, eos_token_ids, train_bpe_tokenizer
from decentrl.model.tiny import build_tiny, save_model_dir

SMALL = ModelConfig(
    tokenizer="bpe", vocab_size=1024, hidden_size=64, num_heads=2, num_layers=1, intermediate_size=128
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up a code.",
            "parameters": {"type": "object", "properties": {"name": {"type": "string"}}},
        },
    }
]
CONVERSATION = [
    {"role": "user", "content": "code of kibo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"name": "kibo"}}}],
    },
    {"role": "tool", "content": "0427"},
    {"role": "assistant", "content": "0427"},
    {"role": "user", "content": "and 12+34?"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(vocab_size=1024, seed=0, num_texts=4000)


def test_training_is_deterministic(tokenizer) -> None:
    again = train_bpe_tokenizer(vocab_size=1024, seed=0, num_texts=4000)
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    other = train_bpe_tokenizer(vocab_size=1024, seed=1, num_texts=4000)
    assert other.backend_tokenizer.to_str() != tokenizer.backend_tokenizer.to_str()


def test_vocabulary_size_and_merges(tokenizer) -> None:
    assert len(tokenizer) == 1024
    # Frequent words of the corpus became single tokens; digits stay one token each.
    assert len(tokenizer.encode("code of")) == 2
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("12+345=")) == list("12+345=")


@pytest.mark.parametrize(
    "text",
    ["12+345=57", "code of kibo?", "  spaces\n\nand\ttabs ", "héllo wörld ✓ 😀", '{"name": "x"}', ""],
)
def test_round_trip(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text  # byte-level: every string, any script, no unknown token


def test_special_tokens_and_eos_ids(tokenizer) -> None:
    assert [tokenizer.convert_tokens_to_ids(t) for t in (ENDOFTEXT, IM_START, IM_END)] == [0, 1, 2]
    assert eos_token_ids(tokenizer) == [2, 0]  # end of turn first, then end of text
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == (2, 0, None)
    for tag in TAG_TOKENS:
        (tag_id,) = tokenizer.encode(tag)
        assert tokenizer.decode([tag_id], skip_special_tokens=True) == tag  # tags are text
    assert tokenizer.decode(tokenizer.encode(f"hi{IM_END}"), skip_special_tokens=True) == "hi"
    with pytest.raises(ValueError, match="model.vocab_size must be >= 263"):
        train_bpe_tokenizer(vocab_size=100)


def test_chat_template_renders_tools_and_tool_calls(tokenizer) -> None:
    text = tokenizer.apply_chat_template(
        CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert text.startswith(f"{IM_START}system\nYou are a helpful assistant.\n\n# Tools")
    assert json.dumps(TOOLS[0]) in text
    assert '<tool_call>\n{"name": "lookup", "arguments": {"name": "kibo"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n0427\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>user\nand 12+34?<|im_end|>\n<|im_start|>assistant\n")
    plain = tokenizer.apply_chat_template(CONVERSATION[:1], tokenize=False, add_generation_prompt=False)
    assert (
        plain
        == f"{IM_START}system\nYou are a helpful assistant.{IM_END}\n{IM_START}user\ncode of kibo?{IM_END}\n"
    )


def test_model_directory_round_trip(tmp_path) -> None:
    model, tokenizer = build_tiny(SMALL)
    assert model.config.eos_token_id == [2, 0] and model.config.bos_token_id is None
    assert model.config.vocab_size == 1024
    assert model.config.hidden_size // model.config.num_attention_heads >= 32
    save_model_dir(model, tokenizer, tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    text = tokenizer.apply_chat_template(
        CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert reloaded.encode(text) == tokenizer.encode(text)
    assert (
        reloaded.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        == text
    )
    assert GenerationConfig.from_pretrained(tmp_path).eos_token_id == [2, 0]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model.eval()(input_ids=ids).logits)
    # The renderer every role uses (tokenizers + jinja only) gives the same ids as transformers.
    chat = ChatFormat.from_model_dir(tmp_path, eos_token_ids=[2, 0])
    assert chat.prompt_ids(CONVERSATION, TOOLS) == reloaded.encode(text)


def test_head_size_below_vllm_minimum_is_refused() -> None:
    with pytest.raises(ValueError, match="hidden_size / model.num_heads must be an integer >= 32"):
        build_tiny(SMALL.model_copy(update={"num_heads": 4}))
