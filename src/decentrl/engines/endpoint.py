"""Evaluation on any OpenAI-compatible completions server (vLLM, SGLang, `decentrl serve`) that
serves its own weights (workers, whose weights change, use `engines/openai.py` with a reload route).

Evaluation only: the weights are the server's own, so `load_weights` is refused. Prompts travel
as token ids (the OpenAI completions API accepts a token-id list as the prompt), so the server
sees exactly the tokens a worker would feed its engine. The completion's token ids come back as
`choices[].token_ids` (vLLM's `return_token_ids`, `decentrl serve`) or as tokens spelled
`token_id:N` (vLLM's `return_tokens_as_token_ids`); a server with neither answers text, which is
encoded with the model's tokenizer (exact for the tokenizers decentrl builds, not for every BPE).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import httpx
from tokenizers import Tokenizer

from decentrl.engines.base import Completion
from decentrl.protocol import SamplingParams

TOKEN_ID_PREFIX = "token_id:"
API_KEY_ENV = "DECENTRL_ENDPOINT_API_KEY"
CONCURRENCY = 16
"""Requests in flight at once."""


class EndpointError(RuntimeError):
    """The endpoint could not be reached or answered something unusable; the message says which."""


class EndpointEngine:
    def __init__(
        self,
        base_url: str,
        tokenizer: Tokenizer,
        eos_token_ids: tuple[int, ...],
        model: str | None = None,
        timeout: float = 600.0,
        api_key: str | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.policy_version = 0
        self.serves_adapters = False  # it serves its own weights: it is never given any
        # The endpoint's API key (`decentrl serve` always wants one): given, or from the environment.
        api_key = api_key or os.environ.get(API_KEY_ENV)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(timeout=timeout, headers=headers)
        self.model = model or self._first_model()

    def _post(self, path: str, body: dict) -> dict:
        try:
            response = self._http.post(f"{self.base_url}{path}", json=body)
        except httpx.HTTPError as exc:
            raise EndpointError(f"{self.base_url}{path}: {exc.__class__.__name__}: {exc}") from None
        if response.status_code != 200:
            raise EndpointError(
                f"{self.base_url}{path} answered {response.status_code}: {response.text[:300]}"
            )
        return response.json()

    def _first_model(self) -> str:
        try:
            listed = self._http.get(f"{self.base_url}/models").json()["data"]
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            raise EndpointError(
                f"{self.base_url}/models did not list models ({exc.__class__.__name__}); "
                "check the URL (it ends in /v1) or set eval.endpoint_model"
            ) from None
        if not listed:
            raise EndpointError(f"{self.base_url}/models lists no model; set eval.endpoint_model")
        return listed[0]["id"]

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, seed: int | None = None
    ) -> list[Completion]:
        """One request per prompt, sent concurrently (servers batch concurrent requests); prompt i
        gets seed + i, so repeated prompts still draw independent samples."""

        def one(index: int) -> Completion:
            body = {
                "model": self.model,
                "prompt": prompts[index],
                "max_tokens": sampling.max_new_tokens,
                "temperature": sampling.temperature,
                "seed": None if seed is None else seed + index,
                "logprobs": 1,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
                "skip_special_tokens": False,
            }
            (choice,) = self._post("/completions", body)["choices"]
            return self._completion(choice)

        with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
            return list(pool.map(one, range(len(prompts))))

    def _completion(self, choice: dict) -> Completion:
        logprobs = choice.get("logprobs") or {}
        tokens = logprobs.get("tokens") or []
        values = [float(v) if v is not None else 0.0 for v in logprobs.get("token_logprobs") or []]
        if choice.get("token_ids") is not None:  # vLLM's return_token_ids, `decentrl serve`
            ids = list(choice["token_ids"])
            values = values if len(values) == len(ids) else [0.0] * len(ids)
        elif tokens and all(t.startswith(TOKEN_ID_PREFIX) for t in tokens):
            ids = [int(t.removeprefix(TOKEN_ID_PREFIX)) for t in tokens]
        else:
            ids = self.tokenizer.encode(choice["text"], add_special_tokens=False).ids
            values = [0.0] * len(ids)
        stopped = choice.get("finish_reason") == "stop"
        if stopped and (not ids or ids[-1] not in self.eos_token_ids):
            # Servers drop the end-of-turn token from a stopped completion; the episode needs it.
            ids, values = [*ids, self.eos_token_ids[0]], [*values, 0.0]
        return Completion(
            token_ids=ids,
            logprobs=values,
            policy_versions=[self.policy_version] * len(ids),
            finish_reason="stop" if stopped else "length",
        )

    def load_weights(self, state_dict: dict, version: int) -> None:
        raise NotImplementedError("an OpenAI-compatible endpoint serves its own weights")

    def update_weights(self, tensors: dict, version: int) -> None:
        raise NotImplementedError("an OpenAI-compatible endpoint serves its own weights")

    def close(self) -> None:
        self._http.close()
