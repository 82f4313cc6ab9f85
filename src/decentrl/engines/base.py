"""Inference engine interface: what a worker needs from vLLM, SGLang or plain transformers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    import torch

    from decentrl.protocol import SamplingParams


class EngineUnavailable(RuntimeError):
    """The configured engine cannot run here (missing extra, unsupported model or server); the
    message names the fix and the worker prints it as one line."""


@dataclass
class Completion:
    """One sampled continuation. `logprobs[i]` is log p(token_ids[i]) under the temperature-scaled
    distribution that sampled it; `policy_versions[i]` is the weight version that produced it."""

    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: Literal["stop", "length"]


class WeightsTarget(Protocol):
    """What a worker's weights are copied into (`worker/weights.py`): an engine, or a stage
    holder's versions of its stage (`worker/stage_versions.py`)."""

    @property
    def policy_version(self) -> int:
        """Version of the weights currently loaded (-1 before the first load)."""
        ...

    serves_adapters: bool
    """Takes a LoRA run's published tensors as they are (`X.lora_A`, `X.lora_B` beside `X.weight`)
    and computes with the adapters unmerged; otherwise it is given the merged W0 + B @ A, which a
    bf16 engine rounds back towards W0 (docs/lora.md)."""

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Copy `state_dict` into the live model in place (no rebuild) and set the version."""
        ...

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Copy a subset of tensors (those a delta changed) in place and switch to `version`,
        never in the middle of a generation."""
        ...


class InferenceEngine(WeightsTarget, Protocol):
    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, seed: int | None = None
    ) -> list[Completion]:
        """Sample one completion per prompt (repeat a prompt for several samples).
        Temperature 0 is greedy; its log-probs are those of the unscaled distribution. The `hf`
        engine of a vision-language policy also takes `images=`: each prompt's images."""
        ...


def group_runs(prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """Consecutive identical prompts as (prompt, count): one request with n = count each."""
    runs: list[tuple[list[int], int]] = []
    for prompt in prompts:
        if runs and runs[-1][0] == prompt:
            runs[-1] = (prompt, runs[-1][1] + 1)
        else:
            runs.append((prompt, 1))
    return runs


def request_seed(seed: int, index: int) -> int:
    """The seed of request `index` of a batch; its samples use seed, seed + 1, ... (vLLM), so the
    requests' seeds are spaced 2**16 apart to never share one (a batch has < 2**16 samples)."""
    return (seed * 7919 + index * (1 << 16)) % (1 << 62)
