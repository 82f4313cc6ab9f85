"""`hf` engine: batched sampling on plain `transformers` models with a KV cache.

Runs on CPU (CUDA or MPS when present), in float32 or `worker.dtype`. Weights are swapped in
place (`load_state_dict`, or `update_weights` for the tensors a delta changed), so the module, its
buffers and any compiled kernels stay; every sampled token records the version that produced it.
LoRA adapters in the published tensors are served unmerged (`model/adapters.py`): merged into a
bf16 weight, a small update would round back to the base.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from decentrl.algo.logprobs import logprobs_from_logits
from decentrl.engines.base import Completion
from decentrl.model import adapters
from decentrl.model.special import read_eos_token_ids, read_pad_token_id
from decentrl.protocol import SamplingParams


def pick_device(device: str) -> torch.device:
    if device != "auto":
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


class HFEngine:
    def __init__(
        self, model: PreTrainedModel, eos_token_ids: Sequence[int], pad_token_id: int, device: str = "auto"
    ):
        assert eos_token_ids, "an engine needs the ids that end a completion"
        self.device = pick_device(device)
        # transformers wraps `to` in a decorator that pyright reads as an unbound function
        self.model = model.to(self.device).eval()  # pyright: ignore[reportArgumentType]
        self.eos_token_ids = list(eos_token_ids)
        """Generation stops at the first of any of these (a model may list several)."""
        self.pad_token_id = pad_token_id
        self.policy_version = -1
        self.serves_adapters = True
        self._lock = threading.Lock()  # a weight swap never interleaves with a generation

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, device: str = "auto", num_threads: int = 1, dtype: str = "float32"
    ) -> HFEngine:
        """Architecture from `config.json` with random weights: the worker loads a published version next."""
        torch.set_num_threads(num_threads)
        config = AutoConfig.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        model_dir = Path(model_dir)
        return cls(model, read_eos_token_ids(model_dir), read_pad_token_id(model_dir), device=device)

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        with self._lock, torch.no_grad():
            adapters.serve(self.model, state_dict)
            missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
            # Tied embeddings may legitimately be absent from a snapshot; anything else is a bad checkpoint.
            missing = [name for name in missing if name != "lm_head.weight"]
            if missing or unexpected:
                raise ValueError(f"weights do not match the model: missing={missing} unexpected={unexpected}")
            self.policy_version = version

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Copy some tensors into the live parameters in place (casting to the engine's dtype) and
        switch the version, atomically with respect to generation (under the same lock)."""
        with self._lock, torch.no_grad():
            adapters.serve(self.model, tensors)
            live = self.model.state_dict()  # shares storage with the parameters (tied ones once)
            unknown = sorted(set(tensors) - set(live))
            if unknown:
                raise ValueError(f"weights do not match the model: unexpected={unknown[:5]}")
            for name, tensor in tensors.items():
                live[name].copy_(tensor)
            self.policy_version = version

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        return ids.to(self.device), mask.to(self.device)

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, seed: int | None = None
    ) -> list[Completion]:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt and no empty prompt")
        with self._lock:
            return self._generate(prompts, sampling, seed)

    def _generate(
        self, prompts: list[list[int]], sampling: SamplingParams, seed: int | None
    ) -> list[Completion]:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed if seed is not None else torch.seed() % 2**63)
        ids_bt, mask_bt = self._left_pad(prompts)
        positions_bt = (mask_bt.cumsum(-1) - 1).clamp(min=0)
        # Only the last position's logits: the prompt's would be batch x length x vocabulary floats
        # (6 GB for 164 HumanEval prompts on SmolLM2's 49k vocabulary), of which one row is used.
        out = self.model(
            input_ids=ids_bt,
            attention_mask=mask_bt,
            position_ids=positions_bt,
            use_cache=True,
            logits_to_keep=1,
        )
        batch = len(prompts)
        tokens, logprobs = [], []
        done_b = torch.zeros(batch, dtype=torch.bool, device=self.device)
        eos_e = torch.tensor(self.eos_token_ids, device=self.device)
        next_position_b = positions_bt[:, -1] + 1
        for _ in range(sampling.max_new_tokens):
            logits_bv = out.logits[:, -1].float()
            if sampling.temperature > 0:
                probs_bv = torch.softmax(logits_bv / sampling.temperature, dim=-1)
                token_b = torch.multinomial(probs_bv, 1, generator=generator).squeeze(-1)
            else:
                token_b = logits_bv.argmax(-1)
            token_b = torch.where(done_b, torch.full_like(token_b, self.pad_token_id), token_b)
            tokens.append(token_b)
            logprobs.append(logprobs_from_logits(logits_bv, token_b, sampling.temperature))
            done_b |= torch.isin(token_b, eos_e)
            if bool(done_b.all()):
                break
            mask_bt = torch.cat([mask_bt, torch.ones((batch, 1), dtype=mask_bt.dtype, device=self.device)], 1)
            out = self.model(
                input_ids=token_b[:, None],
                attention_mask=mask_bt,
                position_ids=next_position_b[:, None],
                cache=out.cache,
                use_cache=True,
            )
            next_position_b = next_position_b + 1
        return self._completions(torch.stack(tokens, 1).tolist(), torch.stack(logprobs, 1).tolist())

    def _completions(self, tokens: list[list[int]], logprobs: list[list[float]]) -> list[Completion]:
        completions = []
        for row_tokens, row_logprobs in zip(tokens, logprobs, strict=True):
            stops = [i for i, token in enumerate(row_tokens) if token in self.eos_token_ids]
            if stops:
                end, reason = stops[0] + 1, "stop"
            else:
                end, reason = len(row_tokens), "length"
            completions.append(
                Completion(
                    token_ids=row_tokens[:end],
                    logprobs=row_logprobs[:end],
                    policy_versions=[self.policy_version] * end,
                    finish_reason=reason,
                )
            )
        return completions
