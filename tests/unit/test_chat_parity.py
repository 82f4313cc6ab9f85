"""The chat renderer every role uses (`tokenizers` + sandboxed Jinja) against `transformers`'
`apply_chat_template`, id for id, on real chat templates: Qwen2.5 with tools, Llama-3 (BOS on
its first turn), Mistral-Instruct and Gemma (both start with `{{ bos_token }}`); prompts, and
multi-turn episodes whose end-of-turn token is not the model's first EOS id (Llama-3.1, Gemma).

Each template comes with a byte-level BPE tokenizer trained here that has the model family's
special tokens, saved as a model directory and read back both ways.
"""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from decentrl.envs.chat import ChatFormat
from decentrl.model.bpe import train_bpe_tokenizer
from decentrl.model.special import read_eos_token_ids

QWEN25 = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    '    {%- for tool in tools %}\n        {{- "\\n" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n'
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n{%- else %}\n'
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n            {{- tool_call.name }}\n'
    '            {{- \'", "arguments": \' }}\n            {{- tool_call.arguments | tojson }}\n'
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

# name: (template, special tokens, bos, the tokenizer's eos_token, eos_token_id of config.json and of
# generation_config.json) as the instruct checkpoints ship them: Qwen2.5 ends turns with its first
# EOS id, Llama-3.1 lists <|end_of_text|> before <|eot_id|> and Gemma <eos> before <end_of_turn>.
FAMILIES = {
    "qwen2.5": (
        QWEN25,
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        None,
        "<|im_end|>",
        ["<|im_end|>"],
        ["<|im_end|>", "<|endoftext|>"],
    ),
    "llama3": (
        LLAMA3,
        [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eom_id|>",
            "<|eot_id|>",
        ],
        "<|begin_of_text|>",
        "<|eot_id|>",
        ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
        ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
    ),
    "mistral": (MISTRAL, ["<unk>", "<s>", "</s>"], "<s>", "</s>", ["</s>"], ["</s>"]),
    "gemma": (
        GEMMA,
        ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
        "<bos>",
        "<eos>",
        ["<eos>"],
        ["<eos>", "<end_of_turn>"],
    ),
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up the code registered under a name.",
            "parameters": {
                "type": "object",
                "properties": {"name": {"type": "string"}},
                "required": ["name"],
            },
        },
    }
]
ALTERNATING = [
    {"role": "user", "content": "What is 12+34?  "},
    {"role": "assistant", "content": "46"},
    {"role": "user", "content": "And héllo → wörld?"},
]
WITH_TOOLS = [
    {"role": "system", "content": "Answer with the code only."},
    {"role": "user", "content": "code of kibo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"name": "kibo"}}}],
    },
    {"role": "tool", "content": "0427"},
    {"role": "assistant", "content": "0427"},
    {"role": "user", "content": "and bado?"},
]


@pytest.fixture(scope="module")
def base_tokenizer():
    return train_bpe_tokenizer(vocab_size=600, seed=3, num_texts=2000).backend_tokenizer


def model_dir(tmp_path, base_tokenizer, family: str):
    template, specials, bos, eos, config_eos, generation_eos = FAMILIES[family]
    backend = type(base_tokenizer).from_str(base_tokenizer.to_str())
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(tmp_path)
    for name, tokens in (("config.json", config_eos), ("generation_config.json", generation_eos)):
        (tmp_path / name).write_text(json.dumps({"eos_token_id": tokenizer.convert_tokens_to_ids(tokens)}))
    return tmp_path, bos


def chat_format(path) -> ChatFormat:
    """The renderer as every role builds it: EOS ids from the model directory's config files."""
    return ChatFormat.from_model_dir(path, read_eos_token_ids(path))


CASES = [
    ("qwen2.5", WITH_TOOLS, TOOLS),
    ("qwen2.5", ALTERNATING, None),
    ("llama3", [{"role": "system", "content": " Be brief. "}, *ALTERNATING], None),
    ("mistral", ALTERNATING, None),
    ("gemma", ALTERNATING, None),
]


@pytest.mark.parametrize(("family", "messages", "tools"), CASES, ids=[c[0] for c in CASES])
def test_renderer_matches_apply_chat_template(tmp_path, base_tokenizer, family, messages, tools) -> None:
    path, bos = model_dir(tmp_path, base_tokenizer, family)
    reference = AutoTokenizer.from_pretrained(path)
    chat = chat_format(path)
    for generation_prompt in (True, False):
        text = reference.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )
        assert chat.render(messages, tools, generation_prompt) == text
        expected = reference.apply_chat_template(
            messages, tools=tools, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
        )
        if generation_prompt:
            assert chat.prompt_ids(messages, tools) == list(expected)
    if bos is not None:  # the real BOS token, once, at the very start
        ids = chat.prompt_ids(messages, tools)
        assert ids[0] == reference.convert_tokens_to_ids(bos)
        assert ids.count(ids[0]) == 1


def end_of_turn(reference, chat: ChatFormat, messages, tools) -> int:
    """The EOS id a chat model samples to end its turn: the one the template writes right after an
    assistant's content (`messages` ends with that assistant message)."""
    text = reference.apply_chat_template(messages, tools=tools, tokenize=False)
    content = messages[-1]["content"]
    after = text[text.rindex(content) + len(content) :]
    [eos_id] = [i for i in chat.eos_token_ids if after.startswith(reference.convert_ids_to_tokens(i))]
    return eos_id


@pytest.mark.parametrize(("family", "messages", "tools"), CASES, ids=[c[0] for c in CASES])
def test_multi_turn_episode_ids_are_the_templates_rendering(
    tmp_path, base_tokenizer, family, messages, tools
) -> None:
    # prompt, then the model's turn ended by the end-of-turn token it samples, then the environment
    # turn: the ids the worker and the coordinator's replay build must be the template's own
    path, _ = model_dir(tmp_path, base_tokenizer, family)
    reference = AutoTokenizer.from_pretrained(path)
    chat = chat_format(path)
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant" and not m.get("tool_calls"))
    ended_with = end_of_turn(reference, chat, messages[: last + 1], tools)
    model_ids = chat.tokenizer.encode(messages[last]["content"], add_special_tokens=False).ids + [ended_with]
    episode_ids = (
        chat.prompt_ids(messages[:last], tools)
        + model_ids
        + chat.env_ids(messages[last + 1 :], tools, ended_with=ended_with)
    )
    expected = reference.apply_chat_template(
        messages, tools=tools, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert reference.decode(episode_ids) == reference.decode(expected)
    assert episode_ids == list(expected)


def test_template_errors_surface_as_value_errors(tmp_path, base_tokenizer) -> None:
    path, _ = model_dir(tmp_path, base_tokenizer, "mistral")
    chat = chat_format(path)
    with pytest.raises(ValueError, match="roles must alternate"):
        chat.prompt_ids([{"role": "assistant", "content": "hi"}])


def test_missing_or_broken_tokenizer_file_names_the_fix(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"tokenizer.json not found.*save_pretrained"):
        ChatFormat.from_model_dir(tmp_path, [0])
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"not a valid tokenizer file.*save_pretrained"):
        ChatFormat.from_model_dir(tmp_path, [0])
