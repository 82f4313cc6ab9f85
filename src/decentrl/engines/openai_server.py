"""`decentrl serve`: an OpenAI-compatible completions/chat server over the `hf` engine.

A judge reward, an evaluation script or any `openai` client can talk to a local model with it:
`POST /v1/completions`, `POST /v1/chat/completions` and `GET /v1/models`, answered in the OpenAI
shapes. Like vLLM's `return_token_ids` extension, every choice also carries its `token_ids` and
the response its `prompt_token_ids`, and `logprobs` are the sampling log-probs of the engine
(`logprobs.token_logprobs` for completions, `logprobs.content[].logprob` for chat), so a trainer
could use the answers without re-tokenizing. Chat prompts go through the model's own chat template
(`envs/chat.py`, the same rendering the workers use). Requests are served one batch at a time;
`n` samples of one prompt are generated as one batch.
"""

import asyncio
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from decentrl.envs.chat import ChatFormat
from decentrl.protocol import SamplingParams

MAX_PROMPT_TOKENS = 8192


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields this server ignores

    model: str = "default"
    max_tokens: int | None = Field(None, ge=1, le=8192)
    max_completion_tokens: int | None = Field(None, ge=1, le=8192)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    n: int = Field(1, ge=1, le=64)
    seed: int | None = None
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

        from decentrl.engines.hf import HFEngine

        torch.set_num_threads(num_threads)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        eos = model.config.eos_token_id
        eos_ids = eos if isinstance(eos, list) else [eos]
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else eos_ids[0]
        self.engine = HFEngine(model, eos_token_ids=eos_ids, pad_token_id=pad, device=device)
        self.chat = ChatFormat.from_model_dir(model_dir, eos_ids)
        self.name = name

    def generate(self, prompt_ids: list[int], request: _Request) -> list[dict]:
        if not prompt_ids or len(prompt_ids) > MAX_PROMPT_TOKENS:
            raise HTTPException(400, f"prompt must have 1..{MAX_PROMPT_TOKENS} tokens, got {len(prompt_ids)}")
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
        app = FastAPI(title="decentrl serve")
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
            prompt = request.prompt
            ids = (
                prompt
                if isinstance(prompt, list)
                else self.chat.tokenizer.encode(prompt, add_special_tokens=False).ids
            )
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
            try:
                ids = self.chat.prompt_ids(tuple(request.messages))
            except (ValueError, KeyError, TypeError) as exc:
                raise HTTPException(
                    400, f"messages cannot be rendered with the chat template: {exc}"
                ) from None
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


def main_serve(model_dir: Path, host: str, port: int, name: str | None = None, num_threads: int = 1) -> int:
    """CLI entry: serve until SIGTERM/SIGINT; prints the URL once the socket accepts connections."""
    import uvicorn

    from decentrl.listen import bind

    server = Server(model_dir, name or model_dir.name, num_threads=num_threads)
    sock = bind(host, port)
    print(f"serving {server.name} at http://{host}:{sock.getsockname()[1]}/v1", flush=True)
    uvicorn.Server(uvicorn.Config(server.app(), log_level="warning")).run(sockets=[sock])
    return 0
