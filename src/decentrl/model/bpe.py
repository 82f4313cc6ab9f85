"""Byte-level BPE tokenizer trained here, with a Qwen2.5-style chat template and tool calls.

The tokenizer of a real-sized test model: what a modern causal LM ships (byte-level BPE, a
pre-tokenizer that splits digits one by one, ChatML turns, `<tool_call>` tags, several
end-of-sequence ids), trained with the `tokenizers` library on text generated here from the
built-in environments, so nothing is downloaded. The same `vocab_size` and `seed` always give the
same tokenizer (the corpus is a pure function of them and the BPE trainer breaks ties by pair).

Two tokens end a sequence, as in Qwen2.5: `<|im_end|>` (end of turn, the one the chat template
writes) and `<|endoftext|>` (end of document, also the padding token). No BOS is prepended.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
"""Control tokens, ids 0, 1, 2; `skip_special_tokens` drops them when decoding."""
TAG_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
"""Tags the chat template and the hermes tool-call format write; one id each, kept when decoding."""
EOS_TOKENS = [IM_END, ENDOFTEXT]
"""End-of-sequence tokens in the order of `config.json`'s `eos_token_id` list (end of turn first)."""

# Qwen2's pre-tokenizer: words with their leading space, single digits, punctuation runs, newlines.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

DEFAULT_SYSTEM = "You are a helpful assistant."

# The Qwen2.5 template (tools declared in the system turn, hermes tool calls, tool results as user
# turns in <tool_response> tags), with this tokenizer's default system prompt.
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- '" + DEFAULT_SYSTEM + "' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
    '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    '{%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}'
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == \"assistant\" %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    '{%- elif message.role == "tool" %}'
    '{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}'
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORD_TEXT = (
    "the a of to and in is it that for on with as was at by this be from or an are not have you "
    "number sum code name answer result value tool call look up find what which how many total "
    "add subtract multiply digit first second third last next please give compute question "
    "registry function argument returns string list python json assistant user system"
)
WORDS = _WORD_TEXT.split()


def _problem_turns(rng: random.Random) -> list[dict]:
    """One generated conversation: arithmetic, a tool lookup (hermes format), or plain prose."""
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randrange(10 ** rng.randint(1, 4)), rng.randrange(10 ** rng.randint(1, 4))
        op = rng.choice("+-*")
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        return [{"role": "user", "content": f"{a}{op}{b}="}, {"role": "assistant", "content": str(answer)}]
    if kind == 1:
        name = "".join(rng.choice(s) for s in ("bdfgklmnprstvz", "aeiou", "bdfgklmnprstvz", "aeiou"))
        code = f"{rng.randrange(10_000):04d}"
        call = json.dumps({"name": "lookup", "arguments": {"name": name}})
        return [
            {"role": "user", "content": f"code of {name}?"},
            {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "content": code},
            {"role": "assistant", "content": code},
        ]
    sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16)))
    return [
        {"role": "user", "content": sentence.capitalize() + "?"},
        {"role": "assistant", "content": sentence},
    ]


def training_corpus(num_texts: int, seed: int) -> Iterator[str]:
    """Generated training text: ChatML conversations as the template lays them out, plus raw
    arithmetic prompts (the `arithmetic` environment encodes its prompts without a template)."""
    rng = random.Random(f"bpe-corpus:{seed}")
    for index in range(num_texts):
        turns = _problem_turns(rng)
        if index % 4 == 0:
            yield f"{turns[0]['content']}{turns[-1]['content']}{IM_END}"
            continue
        text = f"{IM_START}system\n{DEFAULT_SYSTEM}{IM_END}\n"
        for turn in turns:
            text += f"{IM_START}{turn['role']}\n{turn['content']}{IM_END}\n"
        yield text


def train_bpe_tokenizer(
    vocab_size: int = 4096, seed: int = 0, num_texts: int = 20_000
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of at most `vocab_size` tokens (fewer when the corpus runs out
    of merges), with the chat template, `<|im_end|>` as EOS and `<|endoftext|>` as padding."""
    minimum = 256 + len(SPECIAL_TOKENS) + len(TAG_TOKENS)
    if vocab_size < minimum:
        raise ValueError(
            f"model.vocab_size must be >= {minimum} (256 bytes + control tokens), got {vocab_size}"
        )
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TAG_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(training_corpus(num_texts, seed), trainer=trainer)
    backend.add_tokens(TAG_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def eos_token_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """The ids that end a sequence, end of turn first (what `config.json` lists)."""
    ids = tokenizer.convert_tokens_to_ids(list(EOS_TOKENS))
    assert isinstance(ids, list)  # a list of tokens gives a list of ids
    return ids
