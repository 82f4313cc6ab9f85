"""`decentrl serve`: an OpenAI-compatible completions/chat server over the `hf` engine.

A judge reward, an evaluation script or any `openai` client can talk to a local model with it:
`POST /v1/completions`, `POST /v1/chat/completions` and `GET /v1/models`, answered in the OpenAI
shapes. Like vLLM's `return_token_ids` extension, every choice also carries its `token_ids` and
the response its `prompt_token_ids`, and `logprobs` are the sampling log-probs of the engine
(`logprobs.token_logprobs` for completions, `logprobs.content[].logprob` for chat), so a trainer
could use the answers without re-tokenizing. Chat prompts go through the model's own chat template
(`envs/chat.py`, the same rendering the workers use). Requests are served one batch at a time;
`n` samples of one prompt are generated as one batch.

Every request needs the server's bearer token (the OpenAI API key: `--token`, or
`DECENTRL_SERVE_TOKEN`, or one generated at start and printed) and a body of at most 1 MiB, both
checked before the body is read (`serve_guard.py`). A text prompt longer than the most characters
`max_prompt_tokens` tokens can spell is refused before it is tokenised; tokenising and chat
rendering run off the event loop; token ids outside the vocabulary, a prompt that with its
`max_tokens` overflows the model's context, and out-of-range numbers are answered 4xx.
"""

import asyncio
import os
import secrets
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from decentrl.engines.serve_guard import ServeGuard
from decentrl.envs.chat import ChatFormat
from decentrl.protocol import SamplingParams

MAX_PROMPT_TOKENS = 8192
TOKEN_ENV = "DECENTRL_SERVE_TOKEN"


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields this server ignores

    model: str = "default"
    max_tokens: int | None = Field(None, ge=1, le=8192)
    max_completion_tokens: int | None = Field(None, ge=1, le=8192)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    n: int = Field(1, ge=1, le=64)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)  # the range of torch's generator seeds
    stop: str | list[str] | None = None
    logprobs: bool | int | None = None

    @property
    def budget(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 16

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Request):
    prompt: str | list[int]


class ChatRequest(_Request):
    messages: list[dict]


def _cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """`text` up to the first stop string (excluded), and whether one was found."""
    positions = [text.find(stop) for stop in stops if stop and stop in text]
    return (text[: min(positions)], True) if positions else (text, False)


class Server:
    def __init__(self, model_dir: Path, name: str, device: str = "auto", num_threads: int = 1) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from decentrl.config import ConfigError
        from decentrl.engines.hf import HFEngine
        from decentrl.model.special import read_config

        if read_config(model_dir).get("vision_config") is not None:
            raise ConfigError(
                f"{model_dir} holds a vision-language model; decentrl serve serves text-only models"
            )
        torch.set_num_threads(num_threads)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        eos = model.config.eos_token_id
        eos_ids = eos if isinstance(eos, list) else [eos]
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else eos_ids[0]
        self.engine = HFEngine(model, eos_token_ids=eos_ids, pad_token_id=pad, device=device)
        self.chat = ChatFormat.from_model_dir(model_dir, eos_ids)
        self.name = name
        self.vocab_size = model.config.vocab_size
        self.context = getattr(model.config, "max_position_embeddings", None) or MAX_PROMPT_TOKENS + 8192
        self.max_prompt_tokens = min(MAX_PROMPT_TOKENS, self.context - 1)
        # No token spells more characters than its own string in the vocabulary (a byte-level
        # BPE token's string has one character per byte), so a text longer than this cannot fit.
        longest = max(len(token) for token in self.chat.tokenizer.get_vocab())
        self.max_prompt_chars = self.max_prompt_tokens * longest

    def _text_fits(self, chars: int) -> None:
        if chars > self.max_prompt_chars:
            raise HTTPException(
                400, f"prompt of {chars} characters is longer than {self.max_prompt_tokens} tokens can be"
            )

    def completion_ids(self, request: CompletionRequest) -> list[int]:
        """The prompt's token ids: the ids given (each inside the vocabulary), or the text encoded."""
        if isinstance(request.prompt, list):
            outside = [i for i in request.prompt if not 0 <= i < self.vocab_size]
            if outside:
                raise HTTPException(
                    400, f"prompt token ids must be in 0..{self.vocab_size - 1}, got {outside[0]}"
                )
            return request.prompt
        self._text_fits(len(request.prompt))
        return self.chat.tokenizer.encode(request.prompt, add_special_tokens=False).ids

    def chat_ids(self, request: ChatRequest) -> list[int]:
        """The messages rendered with the model's chat template, as token ids."""
        self._text_fits(sum(len(str(message.get("content", ""))) for message in request.messages))
        try:
            return self.chat.prompt_ids(tuple(request.messages))
        except (ValueError, KeyError, TypeError) as exc:
            raise HTTPException(400, f"messages cannot be rendered with the chat template: {exc}") from None

    def generate(self, prompt_ids: list[int], request: _Request) -> list[dict]:
        if not prompt_ids or len(prompt_ids) > self.max_prompt_tokens:
            raise HTTPException(
                400, f"prompt must have 1..{self.max_prompt_tokens} tokens, got {len(prompt_ids)}"
            )
        if len(prompt_ids) + request.budget > self.context:
            raise HTTPException(
                400,
                f"prompt of {len(prompt_ids)} tokens and max_tokens {request.budget} exceed the model's "
                f"context of {self.context} tokens; shorten the prompt or lower max_tokens",
            )
        sampling = SamplingParams(temperature=request.temperature, max_new_tokens=request.budget)
        completions = self.engine.generate([prompt_ids] * request.n, sampling, seed=request.seed)
        choices = []
        for index, completion in enumerate(completions):
            ids = list(completion.token_ids)
            ended = ids and ids[-1] in self.chat.eos_token_ids
            text = self.chat.tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
            text, stopped = _cut(text, request.stops)
            finish = "stop" if ended or stopped else "length"
            tokens = [self.chat.tokenizer.id_to_token(i) or "" for i in ids]
            choices.append(
                {
                    "index": index,
                    "text": text,
                    "finish_reason": finish,
                    "token_ids": ids,
                    "tokens": tokens,
                    "logprobs": list(completion.logprobs),
                }
            )
        return choices

    def app(self) -> FastAPI:
        # No /docs or /openapi.json: nothing is served without the token, and nothing more is needed.
        app = FastAPI(title="decentrl serve", docs_url=None, redoc_url=None, openapi_url=None)
        lock = asyncio.Lock()  # one generation at a time: the engine holds one model

        async def run(prompt_ids: list[int], request: _Request) -> list[dict]:
            async with lock:
                return await asyncio.to_thread(self.generate, prompt_ids, request)

        def envelope(kind: str, prompt_ids: list[int], choices: list[dict]) -> dict:
            generated = sum(len(choice["token_ids"]) for choice in choices)
            return {
                "id": f"{kind}-{uuid.uuid4().hex[:16]}",
                "object": kind,
                "created": int(time.time()),
                "model": self.name,
                "choices": choices,
                "prompt_token_ids": prompt_ids,
                "usage": {
                    "prompt_tokens": len(prompt_ids),
                    "completion_tokens": generated,
                    "total_tokens": len(prompt_ids) + generated,
                },
            }

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": self.name, "object": "model", "owned_by": "decentrl"}]}

        @app.post("/v1/completions")
        async def completions(request: CompletionRequest) -> dict:
            ids = await asyncio.to_thread(self.completion_ids, request)  # a long text takes a while
            choices = [
                {
                    "index": c["index"],
                    "text": c["text"],
                    "finish_reason": c["finish_reason"],
                    "token_ids": c["token_ids"],
                    "logprobs": {"tokens": c["tokens"], "token_logprobs": c["logprobs"]}
                    if request.logprobs
                    else None,
                }
                for c in await run(ids, request)
            ]
            return envelope("text_completion", ids, choices)

        @app.post("/v1/chat/completions")
        async def chat(request: ChatRequest) -> dict:
            ids = await asyncio.to_thread(self.chat_ids, request)
            choices = [
                {
                    "index": c["index"],
                    "finish_reason": c["finish_reason"],
                    "token_ids": c["token_ids"],
                    "message": {"role": "assistant", "content": c["text"]},
                    "logprobs": {
                        "content": [
                            {"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                            for t, lp in zip(c["tokens"], c["logprobs"], strict=True)
                        ]
                    }
                    if request.logprobs
                    else None,
                }
                for c in await run(ids, request)
            ]
            return envelope("chat.completion", ids, choices)

        return app


def main_serve(
    model_dir: Path,
    host: str,
    port: int,
    name: str | None = None,
    num_threads: int = 1,
    token: str | None = None,
) -> int:
    """CLI entry: serve until SIGTERM/SIGINT; prints the URL once the socket accepts connections,
    and the token when it generated one (`token`, else `DECENTRL_SERVE_TOKEN`, else a new one)."""
    import uvicorn

    from decentrl.listen import absorb_reraised_signals, bind

    given = token or os.environ.get(TOKEN_ENV)
    token = given or secrets.token_urlsafe(24)
    server = Server(model_dir, name or model_dir.name, num_threads=num_threads)
    sock = bind(host, port)
    shown = "the token given" if given else f"token {token} (set {TOKEN_ENV} or --token to choose it)"
    uvicorn_server = uvicorn.Server(uvicorn.Config(ServeGuard(server.app(), token), log_level="warning"))
    try:
        with absorb_reraised_signals(uvicorn_server):  # a stop right after the URL is printed is graceful
            print(
                f"serving {server.name} at http://{host}:{sock.getsockname()[1]}/v1 with {shown}", flush=True
            )
            uvicorn_server.run(sockets=[sock])
    finally:
        sock.close()
    return 0
