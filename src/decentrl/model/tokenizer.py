"""Character-level tokenizer for the embedded default: a real `PreTrainedTokenizerFast`.

One token per printable ASCII character (plus newline), so every prompt and answer round-trips
exactly and token ids can be checked against the vocabulary. No BOS is prepended (vLLM's CPU
backend serves the same files unchanged).
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, EOS, UNK]
CHARACTERS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # 95 printable + '\n'

# The tiny tokenizer's own chat template: one "role: content" line per message, then an
# assistant header when asked for a generation prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
