"""Chat formatting from the model's own chat template, with the `tokenizers` library only.

The coordinator (no torch, no transformers), the worker, the warm start and evaluation all turn
messages into token ids through `ChatFormat`, so a prompt or an environment turn has exactly the
same ids everywhere and the coordinator can replay a worker's environment turns id for id. The
template is rendered with a sandboxed Jinja environment configured like `transformers`'.

Environment turns are the text that the template puts after an assistant turn: the rest of the
rendering of `[..., assistant, env messages]` with a generation prompt, after the assistant's
content and the end-of-turn token the model itself sampled (the one its turn ended with, which is
not always the model's first EOS id).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer

from decentrl.envs.base import Message, completion_text
from decentrl.envs.image_tokens import ImageTokens, read_image_tokens

# Placeholders located in a rendering to cut out the environment's part of it.
USER_MARK, ASSISTANT_MARK = "\u2063user-mark\u2063", "\u2063assistant-mark\u2063"


class ChatTemplateMissing(ValueError):
    """The environment's prompts are chat messages but the model has no chat template."""


class ChatFormat:
    def __init__(
        self,
        tokenizer: Tokenizer,
        template: str | None,
        eos_token_ids: Sequence[int],
        special_tokens: dict[str, str] | None = None,
        image_tokens: ImageTokens | None = None,
    ):
        assert eos_token_ids, "a chat format needs the model's end-of-turn token"
        self.tokenizer = tokenizer
        self.image_tokens = image_tokens
        """A vision-language model's image tokens: each image placeholder a prompt encodes to is
        expanded to the image's tokens (`envs/image_tokens.py`); None for a text-only model."""
        self.template = template
        self.eos_token_ids = tuple(eos_token_ids)
        # What templates call bos_token, eos_token, ...: the tokenizer config's strings, as
        # `transformers` passes them; the end-of-turn token stands in for a missing eos_token.
        self.special_tokens = {
            "bos_token": "",
            "eos_token": tokenizer.id_to_token(self.eos_token_ids[0]) or "",
        }
        self.special_tokens.update(special_tokens or {})

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, eos_token_ids: Sequence[int]) -> ChatFormat:
        model_dir = Path(model_dir)
        return cls(
            load_tokenizer(model_dir),
            read_chat_template(model_dir),
            eos_token_ids,
            read_special_tokens(model_dir),
            read_image_tokens(model_dir),
        )

    @classmethod
    def from_hf(cls, tokenizer, image_tokens: ImageTokens | None = None) -> ChatFormat:
        """From a `transformers` fast tokenizer (the warm start and evaluation hold one)."""
        special = {name: getattr(tokenizer, name) for name in SPECIAL_TOKEN_NAMES if getattr(tokenizer, name)}
        eos = [tokenizer.eos_token_id]
        return cls(tokenizer.backend_tokenizer, tokenizer.chat_template, eos, special, image_tokens)

    @cached_property
    def _compiled(self):
        if self.template is None:
            raise ChatTemplateMissing(
                "this environment's prompts are chat messages but the model has no chat template; "
                "add chat_template.jinja to the model directory"
            )
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, indent=indent, ensure_ascii=False
        )
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.template)

    def render(self, messages: Sequence[Message], tools: list[dict] | None, generation_prompt: bool) -> str:
        return self._compiled.render(
            messages=list(messages),
            tools=tools or None,
            add_generation_prompt=generation_prompt,
            **self.special_tokens,
        )

    def prompt_ids(self, prompt: str | Sequence[Message], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a problem's prompt: raw text as is, or messages through the template; a
        vision-language model's image placeholders expanded to each image's tokens."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt).ids
        else:
            text = self.render(prompt, tools, generation_prompt=True)
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ids if self.image_tokens is None else self.image_tokens.expand(ids)

    def env_ids(
        self, messages: Sequence[Message], tools: list[dict] | None = None, *, ended_with: int
    ) -> list[int]:
        """Token ids of environment messages after an assistant turn that the model ended with the
        end-of-turn token `ended_with`, up to the next assistant header."""
        assert ended_with in self.eos_token_ids, "an environment turn follows a turn ended by an EOS token"
        context = [{"role": "user", "content": USER_MARK}, {"role": "assistant", "content": ASSISTANT_MARK}]
        text = self.render(context + list(messages), tools, generation_prompt=True)
        start = text.find(ASSISTANT_MARK)
        assert start >= 0, "the chat template dropped the assistant's content"
        rest = text[start + len(ASSISTANT_MARK) :]
        # The template writes its end-of-turn token here and the model has already sampled one: drop
        # the one it sampled, not the first EOS id, which on Llama-3.1 is <|end_of_text|> (the
        # template writes <|eot_id|>) and on Gemma <eos> (it writes <end_of_turn>). A model that
        # ended with another EOS keeps it, and the template's end of turn follows it.
        sampled = self.tokenizer.id_to_token(ended_with) or ""
        if sampled and rest.startswith(sampled):
            rest = rest[len(sampled) :]
        return self.tokenizer.encode(rest, add_special_tokens=False).ids

    def turn_text(self, token_ids: list[int]) -> str:
        """The text of one assistant turn (see `completion_text`)."""
        return completion_text(self.tokenizer, token_ids, self.eos_token_ids)


SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


def load_tokenizer(model_dir: Path) -> Tokenizer:
    """The model's `tokenizer.json`; a missing or unreadable one is a ValueError naming the fix."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ValueError(
            f"{path} not found: decentrl needs a fast tokenizer file; save one with "
            "AutoTokenizer.from_pretrained(...).save_pretrained(model_dir)"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises bare Exceptions on bad files
        raise ValueError(
            f"{path} is not a valid tokenizer file ({str(exc).splitlines()[0][:120]}); "
            "re-save it with AutoTokenizer.from_pretrained(...).save_pretrained(model_dir)"
        ) from None


def read_special_tokens(model_dir: Path) -> dict[str, str]:
    """bos/eos/pad/unk token strings from `tokenizer_config.json`, else `special_tokens_map.json`."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the later file wins
        path = model_dir / name
        if not path.is_file():
            continue
        config = json.loads(path.read_text())
        for key in SPECIAL_TOKEN_NAMES:
            value = config.get(key)
            if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
                value = value.get("content")
            if isinstance(value, str):
                found[key] = value
    return found


def read_chat_template(model_dir: Path) -> str | None:
    """`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`, else None."""
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    config = model_dir / "tokenizer_config.json"
    if config.is_file():
        template = json.loads(config.read_text()).get("chat_template")
        if isinstance(template, str):
            return template
    return None
