"""`hf` engine: batched sampling on plain `transformers` models with a KV cache.

Runs on CPU (CUDA or MPS when present), in float32 or `worker.dtype`. Weights are swapped in
place (`load_state_dict`, or `update_weights` for the tensors a delta changed), so the module, its
buffers and any compiled kernels stay; every sampled token records the version that produced it.
LoRA adapters in the published tensors are served unmerged (`model/adapters.py`): merged into a
bf16 weight, a small update would round back to the base. A vision-language policy
(`model/vision.py`) takes each prompt's images too: their pixels go into the prefill, whose
image tokens the model fills with the vision tower's features; the KV cache holds them after.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel

from decentrl.engines.base import Completion
from decentrl.engines.sampling import LeftPadded, check_prompts, completions, left_pad_ids, sample_loop
from decentrl.envs.images import TaskImage
from decentrl.model import adapters
from decentrl.model.special import read_eos_token_ids, read_pad_token_id
from decentrl.model.vision import PixelInputs, move_vision, policy_from_config
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
        self,
        model: PreTrainedModel,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        device: str = "auto",
        pixels: PixelInputs | None = None,
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
        self.pixels = pixels
        """A vision-language policy's image processor (`generate` takes images); None: text only."""
        image_token = getattr(model.config, "image_token_id", None)
        self.suppressed_ids = [] if pixels is None or image_token is None else [int(image_token)]
        """Ids no completion may contain: a processor alone places image tokens."""
        self._lock = threading.Lock()  # a weight swap never interleaves with a generation

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, device: str = "auto", num_threads: int = 1, dtype: str = "float32"
    ) -> HFEngine:
        """Architecture from `config.json` with random weights: the worker loads a published version next."""
        torch.set_num_threads(num_threads)
        model = policy_from_config(model_dir, getattr(torch, dtype))
        model_dir = Path(model_dir)
        eos, pad = read_eos_token_ids(model_dir), read_pad_token_id(model_dir)
        return cls(model, eos, pad, device=device, pixels=PixelInputs.from_model_dir(model_dir))

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

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        seed: int | None = None,
        images: Sequence[Sequence[TaskImage]] | None = None,
    ) -> list[Completion]:
        """As `InferenceEngine.generate`; a vision-language policy also takes each prompt's
        images (`images[i]`, in the order of prompt i's image tokens)."""
        check_prompts(prompts)
        vision = None
        if images is not None:
            if self.pixels is None:
                raise ValueError("this engine's model is text-only; it takes no images")
            assert len(images) == len(prompts), "one list of images per prompt"
            vision = self.pixels.vision_inputs(images)
        with self._lock:
            return self._generate(prompts, sampling, seed, vision)

    def _generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        seed: int | None,
        vision: dict[str, torch.Tensor] | None = None,
    ) -> list[Completion]:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed if seed is not None else torch.seed() % 2**63)
        ids_bt = left_pad_ids(prompts, self.pad_token_id).to(self.device)
        padded = LeftPadded([len(p) for p in prompts], ids_bt.shape[1], self.device)
        # Only the last position's logits: the prompt's would be batch x length x vocabulary floats
        # (6 GB for 164 HumanEval prompts on SmolLM2's 49k vocabulary), of which one row is used.
        out = self.model(
            input_ids=ids_bt,
            attention_mask=padded.mask_bt,
            position_ids=padded.positions_bt,
            use_cache=True,
            logits_to_keep=1,
            **move_vision(vision, self.device, self.model.dtype),
        )
        cache = out.cache

        def next_logits(token_b: torch.Tensor) -> torch.Tensor:
            nonlocal cache
            positions_b1 = padded.grow()
            step = self.model(
                input_ids=token_b[:, None],
                attention_mask=padded.mask_bt,
                position_ids=positions_b1,
                cache=cache,
                use_cache=True,
            )
            cache = step.cache
            return step.logits[:, -1]

        tokens, logprobs = sample_loop(
            out.logits[:, -1],
            next_logits,
            sampling,
            generator,
            self.eos_token_ids,
            self.pad_token_id,
            self.suppressed_ids,
        )
        return completions(tokens, logprobs, self.eos_token_ids, self.policy_version)
