"""Chat formatting from the model's own chat template, with the `tokenizers` library only.

The coordinator (no torch, no transformers), the worker, the warm start and evaluation all turn
messages into token ids through `ChatFormat`, so a prompt or an environment turn has exactly the
same ids everywhere and the coordinator can replay a worker's environment turns id for id. The
template is rendered with a sandboxed Jinja environment configured like `transformers`'.

Environment turns are the text that the template puts after an assistant turn: the rest of the
rendering of `[..., assistant, env messages]` with a generation prompt, after the assistant's
content and the end-of-turn token the model itself sampled.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer

from decentrl.envs.base import Message, completion_text

# Placeholders located in a rendering to cut out the environment's part of it.
USER_MARK, ASSISTANT_MARK = "\u2063user-mark\u2063", "\u2063assistant-mark\u2063"


class ChatTemplateMissing(ValueError):
    """The environment's prompts are chat messages but the model has no chat template."""


class ChatFormat:
    def __init__(self, tokenizer: Tokenizer, template: str | None, eos_token_ids: Sequence[int]):
        assert eos_token_ids, "a chat format needs the model's end-of-turn token"
        self.tokenizer = tokenizer
        self.template = template
        self.eos_token_ids = tuple(eos_token_ids)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, eos_token_ids: Sequence[int]) -> ChatFormat:
        model_dir = Path(model_dir)
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        return cls(tokenizer, read_chat_template(model_dir), eos_token_ids)

    @classmethod
    def from_hf(cls, tokenizer) -> ChatFormat:
        """From a `transformers` fast tokenizer (the warm start and evaluation hold one)."""
        return cls(tokenizer.backend_tokenizer, tokenizer.chat_template, [tokenizer.eos_token_id])

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
        special = {
            "bos_token": "",
            "eos_token": self.tokenizer.id_to_token(self.eos_token_ids[0]) or "",
        }
        return self._compiled.render(
            messages=list(messages), tools=tools or None, add_generation_prompt=generation_prompt, **special
        )

    def prompt_ids(self, prompt: str | Sequence[Message], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a problem's prompt: raw text as is, or messages through the template."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt).ids
        text = self.render(prompt, tools, generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def env_ids(self, messages: Sequence[Message], tools: list[dict] | None = None) -> list[int]:
        """Token ids of environment messages after an assistant turn, up to the next assistant header."""
        context = [{"role": "user", "content": USER_MARK}, {"role": "assistant", "content": ASSISTANT_MARK}]
        text = self.render(context + list(messages), tools, generation_prompt=True)
        start = text.find(ASSISTANT_MARK)
        assert start >= 0, "the chat template dropped the assistant's content"
        rest = text[start + len(ASSISTANT_MARK) :]
        eos_text = self.tokenizer.id_to_token(self.eos_token_ids[0]) or ""
        if eos_text and rest.startswith(eos_text):  # the model sampled its own end-of-turn token
            rest = rest[len(eos_text) :]
        return self.tokenizer.encode(rest, add_special_tokens=False).ids

    def turn_text(self, token_ids: list[int]) -> str:
        """The text of one assistant turn (see `completion_text`)."""
        return completion_text(self.tokenizer, token_ids, self.eos_token_ids)


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
