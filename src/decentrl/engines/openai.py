"""`openai` engine: drive an inference server the operator already runs, over its OpenAI-compatible
completions API, with token ids in and out.

Prompts go as token-id lists and completions come back as token ids (`return_token_ids`, vLLM's
extension) with the sampled tokens' log-probs, so nothing is re-tokenized. One `generate` sends
one request per run of identical prompts (`n` samples, its own seed), all at once: the server's
continuous batching runs the lease as one batch.

Weights: after each verified version the worker writes the whole reconstructed state as one
safetensors file into `weights_dir` (which the server must read at the same path) and calls the
server's reload route: vLLM (started with `VLLM_SERVER_DEV_MODE=1`) `POST /collective_rpc`
{"method": "reload_weights", "kwargs": {"weights_path": ...}} then `POST /reset_prefix_cache`;
SGLang `POST /update_weights_from_disk` {"model_path": ..., "flush_cache": true}. At start the
engine refuses, with the fix in one line, a server that is not there, cannot reload, does not
return token ids, reports log-probs that ignore the temperature (vLLM's default `raw_logprobs`;
the trainer's are temperature-scaled: `--logprobs-mode processed_logprobs`), or ignores a
sampling field that decentrl sends as neutral.

Sampling: vLLM and SGLang fill every sampling field a request leaves out from the model's
`generation_config.json` (Qwen2.5-Instruct: top_p 0.8, top_k 20, repetition_penalty 1.05), and
the trainer models the plain temperature-scaled softmax. So every request names all of them with
their neutral values (`NEUTRAL_SAMPLING`).
"""

from __future__ import annotations

import logging
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

from decentrl.engines.base import Completion, EngineUnavailable, group_runs, request_seed
from decentrl.engines.model_info import load_eos_token_ids, state_layout
from decentrl.protocol import SamplingParams

log = logging.getLogger(__name__)

MODEL_FILES = ("config.json", "generation_config.json")
"""Non-weight files copied next to the weights: SGLang reloads a whole checkpoint directory."""


NEUTRAL_SAMPLING = {
    "top_p": 1.0,
    "top_k": -1,  # no cut-off on vLLM (-1 or 0) and on SGLang (-1)
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
"""The sampling fields a server otherwise takes from the model's generation_config.json, at the
values that leave the temperature-scaled softmax unchanged."""

TRUNCATING_PROBES = {"top_k": 1, "top_p": 1e-6, "min_p": 1.0}
"""A value of each truncating field that keeps only the most likely token."""

MEASURABLE_LOGPROB = -1e-2
"""A repetition probe needs a repeated token this much below certainty: a penalty's effect on a
log-prob near 0 is below float32 resolution."""


class ReloadRoute(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"


class OpenAIEngine:
    def __init__(self, url: str, model_dir: str | Path, weights_dir: str | Path, timeout: float = 300.0):
        self.url = url.rstrip("/")
        self.device = f"server {self.url}"
        self.http = httpx.Client(base_url=self.url, timeout=timeout)
        self.model_dir = Path(model_dir)
        self.weights_dir = Path(weights_dir).resolve()
        self.eos_token_ids = load_eos_token_ids(model_dir)
        layout = state_layout(model_dir)
        self.shapes, self.tied = layout.shapes, layout.tied
        self.model = self._served_model()
        self.route = self._reload_route()
        self._check_completions()
        self._check_sampling_fields()
        self._state: dict[str, torch.Tensor] = {}
        self.policy_version = -1
        self.serves_adapters = False  # the server is given merged weights (docs/lora.md, Limits)
        self._lock = threading.Lock()

    @classmethod
    def from_worker(cls, url: str | None, model_dir: Path, weights_dir: Path) -> OpenAIEngine:
        if not url:
            raise EngineUnavailable(
                "worker.engine = 'openai' needs worker.openai_url (the server's base URL)"
            )
        return cls(url, model_dir, weights_dir)

    def close(self) -> None:
        self.http.close()

    # ------------------------------------------------------------------ start-up checks

    def _served_model(self) -> str:
        try:
            models = self.http.get("/v1/models").raise_for_status().json()["data"]
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise EngineUnavailable(
                f"no OpenAI-compatible server answers at {self.url}/v1/models ({exc}); start it first or fix "
                "worker.openai_url"
            ) from None
        return models[0]["id"]

    def _reload_route(self) -> ReloadRoute:
        if self.http.post("/reset_prefix_cache").status_code == 200:
            return ReloadRoute.VLLM  # a vLLM server's dev routes (/collective_rpc) are on
        if self.http.get("/get_server_info").status_code == 200:
            return ReloadRoute.SGLANG
        raise EngineUnavailable(
            f"the server at {self.url} has no weight-reload route, so it would sample with stale weights: "
            "start vLLM with VLLM_SERVER_DEV_MODE=1 (POST /collective_rpc) or use SGLang "
            "(POST /update_weights_from_disk)"
        )

    def _complete(
        self, prompt: list[int], count: int, temperature: float, max_tokens: int, seed: int | None, **probe
    ):
        """One completions request; `probe` replaces fields for the start-up checks only."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "n": count,
            "temperature": temperature,
            "max_tokens": max_tokens,
            "logprobs": 1,  # top-1 plus the sampled token; token_logprobs is the sampled token's
            "seed": seed,
            "return_token_ids": True,
            "stop_token_ids": list(self.eos_token_ids),
            "skip_special_tokens": False,
            **NEUTRAL_SAMPLING,
            **probe,
        }
        response = self.http.post("/v1/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(
                f"{self.url}/v1/completions answered {response.status_code}: {response.text[:300]}"
            )
        return sorted(response.json()["choices"], key=lambda choice: choice["index"])

    def _check_completions(self) -> None:
        prompt = [self.eos_token_ids[0]]
        cold, hot = (self._complete(prompt, 1, t, 1, seed=0)[0] for t in (0.25, 2.0))
        if cold.get("token_ids") is None:
            raise EngineUnavailable(
                f"the server at {self.url} does not return completion token ids, and decentrl never "
                "re-tokenizes text: use a server with `return_token_ids` (vLLM >= 0.10.2)"
            )
        top = [max(choice["logprobs"]["top_logprobs"][0].values()) for choice in (cold, hot)]
        # The most likely token's log-prob moves with the temperature only when the server reports
        # temperature-scaled log-probs (a uniform model is the exception; random init is not uniform).
        if abs(top[0] - top[1]) < 1e-4:
            raise EngineUnavailable(
                f"the server at {self.url} reports log-probs before temperature scaling; the trainer's "
                "are after it: start vLLM with --logprobs-mode processed_logprobs"
            )

    def _check_sampling_fields(self) -> None:
        """Refuse a server that ignores top_k, top_p, min_p or repetition_penalty: it would fill them
        from generation_config.json instead. Each probe sets one field to a value whose effect on
        the reported (processed) log-probs is certain. presence_penalty and frequency_penalty are
        OpenAI's own fields, which every compatible server reads."""
        prompt = [self.eos_token_ids[0]]
        for name, value in TRUNCATING_PROBES.items():
            choice = self._complete(prompt, 1, 1.0, 1, seed=0, **{name: value})[0]
            if choice["logprobs"]["token_logprobs"][0] < -1e-4:  # one token left: log-prob exactly 0
                raise self._ignored(name)
        # A greedy run; each step whose token repeats one before it is a prompt whose argmax is in
        # the prompt, where repetition_penalty must move that token's log-prob or its place.
        free = {"stop_token_ids": [], "ignore_eos": True}
        neutral = self._complete(prompt, 1, 0.0, 64, seed=0, **free)[0]
        context = prompt + list(neutral["token_ids"])
        logprobs = neutral["logprobs"]["token_logprobs"]
        repeats = [j for j in range(len(logprobs)) if context[len(prompt) + j] in context[: len(prompt) + j]]
        if not repeats or min(logprobs[j] for j in repeats) > MEASURABLE_LOGPROB:
            log.warning(
                "the server's greedy probe found no measurable repeat: repetition_penalty not verified"
            )
            return
        step = min(repeats, key=lambda j: logprobs[j])
        probe = self._complete(context[: len(prompt) + step], 1, 0.0, 1, seed=0, repetition_penalty=2.0)[0]
        same_token = probe["token_ids"][0] == context[len(prompt) + step]
        if same_token and abs(probe["logprobs"]["token_logprobs"][0] - logprobs[step]) < 1e-4:
            raise self._ignored("repetition_penalty")

    def _ignored(self, name: str) -> EngineUnavailable:
        return EngineUnavailable(
            f"the server at {self.url} ignores the request's `{name}`, so it may sample from a distribution "
            "the trainer does not model: use vLLM or SGLang, started with --logprobs-mode processed_logprobs"
        )

    # ------------------------------------------------------------------ weights

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self._state = {}
        self.update_weights(state_dict, version)

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        unknown = sorted(set(tensors) - set(self.shapes))
        if unknown:
            raise ValueError(f"weights do not match the model: unexpected={unknown[:5]}")
        with self._lock:
            self._state.update(tensors)
            self._write()
            self._reload()
            self.policy_version = version

    def _write(self) -> None:
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        for name in MODEL_FILES:
            if (self.model_dir / name).is_file():
                shutil.copyfile(self.model_dir / name, self.weights_dir / name)
        partial = self.weights_dir / "model.safetensors.partial"
        tensors = {name: tensor.contiguous() for name, tensor in self._state.items()}
        for alias, source in self.tied.items():
            # A tied output layer is written out as its own copy: vLLM's CPU backend refreshes it
            # only when the checkpoint holds it, and safetensors refuses two names for one tensor.
            if source in tensors:
                tensors[alias] = tensors[source].clone()
        save_file(tensors, str(partial))
        partial.replace(self.weights_dir / "model.safetensors")  # the server never reads half a file

    def _reload(self) -> None:
        if self.route is ReloadRoute.VLLM:
            steps = [
                (
                    "/collective_rpc",
                    {"method": "reload_weights", "kwargs": {"weights_path": str(self.weights_dir)}},
                ),
                ("/reset_prefix_cache", None),  # KV cached under the old weights must not be reused
            ]
        else:
            steps = [
                ("/update_weights_from_disk", {"model_path": str(self.weights_dir), "flush_cache": True})
            ]
        for path, body in steps:
            response = self.http.post(path, json=body)
            if response.status_code != 200 or (
                isinstance(body, dict) and response.json().get("success") is False
            ):
                raise RuntimeError(
                    f"{self.url}{path} refused the reload ({response.status_code}): {response.text[:300]}"
                )

    # ------------------------------------------------------------------ sampling

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, seed: int | None = None
    ) -> list[Completion]:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt and no empty prompt")
        # vLLM refuses n > 1 for greedy requests (the samples would be identical anyway)
        runs = group_runs(prompts) if sampling.temperature > 0 else [(prompt, 1) for prompt in prompts]
        with self._lock, ThreadPoolExecutor(max_workers=min(len(runs), 64)) as pool:
            version = self.policy_version
            futures = [
                pool.submit(
                    self._complete,
                    prompt,
                    count,
                    sampling.temperature,
                    sampling.max_new_tokens,
                    None if seed is None else request_seed(seed, index),
                )
                for index, (prompt, count) in enumerate(runs)
            ]
            choices = [choice for future in futures for choice in future.result()]
        completions = []
        for choice in choices:
            ids = list(choice["token_ids"])
            logprobs = choice["logprobs"]["token_logprobs"]
            assert len(logprobs) == len(ids), "the server's log-probs do not line up with its tokens"
            completions.append(
                Completion(
                    token_ids=ids,
                    logprobs=[float(x) for x in logprobs],
                    policy_versions=[version] * len(ids),
                    finish_reason="stop" if ids and ids[-1] in self.eos_token_ids else "length",
                )
            )
        assert len(completions) == len(prompts)
        return completions
