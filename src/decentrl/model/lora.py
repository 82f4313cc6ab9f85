"""LoRA training (Hu et al. 2021, arXiv:2106.09685) with `peft`, and how its weights travel.

The trainer wraps its model with `peft` adapters on every linear layer of the decoder
(`lora.rank > 0`). Only the adapters train, so between two versions only they change: the bf16
delta of a version is about the adapters' size (2 % of the tiny demo model at rank 2) instead of
every element Adam touched. Thinking Machines' "LoRA Without Regret" (2025) measured that RL
post-training matches full fine-tuning even at rank 1, with a learning rate about 10x the
full-parameter one, because a policy-gradient step carries only O(1) bits per episode.

**Published layout.** Workers never import `peft`. A published state names every base tensor as
in the plain `transformers` model (`model.layers.0.self_attn.q_proj.weight`) and, per adapted
linear layer `X`, two more tensors: `X.lora_A` (rank x in) and `X.lora_B` (out x rank) with the
adapter's scaling alpha / rank folded into B. The state is self-describing; `merge` turns it into
the plain model's state, W = W0 + B @ A, computed in float32 from the inference-dtype tensors, by
the workers, the verifier and the evaluation alike, so all of them run the same weights.
"""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch

from decentrl.config import LoraConfig
from decentrl.weights.unique_storage import state_for_publication

PEFT_PREFIX = "base_model.model."
ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


def attach(model: torch.nn.Module, config: LoraConfig) -> torch.nn.Module:
    """`model` wrapped with trainable LoRA adapters (the base frozen), or `model` when rank is 0."""
    if config.rank == 0:
        return model
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    adapters = PeftLoraConfig(
        r=config.rank,
        # peft annotates lora_alpha as int, but scales by alpha / r in floating point either way
        lora_alpha=config.alpha,  # pyright: ignore[reportArgumentType]
        target_modules=target_modules(model, config),
        lora_dropout=0.0,
        bias="none",
    )
    with warnings.catch_warnings():  # peft probes a deprecated transformers property
        warnings.simplefilter("ignore", FutureWarning)
        return get_peft_model(model, adapters)


def target_modules(model: torch.nn.Module, config: LoraConfig) -> str | list[str]:
    """`config.target_modules`; on a vision-language model "all-linear" names the language model's
    linear layers (with `lora.vision_tower`, the vision tower's and the projector's too), never
    the output head."""
    causal: Any = model
    if config.target_modules != "all-linear" or getattr(causal.config, "vision_config", None) is None:
        return config.target_modules
    language = {id(module) for module in causal.get_decoder().modules()}
    head = causal.get_output_embeddings()
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and module is not head
        and (id(module) in language or config.vision_tower)
    ]


def _is_peft(model: torch.nn.Module) -> bool:
    return any(name.startswith(PEFT_PREFIX) for name, _ in model.named_parameters())


def publication_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the trainer publishes: the plain state, or for a `peft` model the base tensors under
    their plain names plus each layer's `lora_A` and scaled `lora_B` (detached)."""
    if not _is_peft(model):
        return state_for_publication(model)
    (config,) = cast(Any, model).peft_config.values()  # a peft model; torch.nn.Module does not say so
    assert not config.rank_pattern and not config.alpha_pattern, "one scaling for every layer"
    return publication_layout(state_for_publication(model), config.lora_alpha / config.r)


def publication_layout(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A `peft` state dict (the trainer's checkpoint) in the published layout, B scaled."""
    out = {}
    for name, tensor in state.items():
        plain = name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
        if ".lora_A." in plain or ".lora_B." in plain:  # X.lora_A.<adapter>.weight -> X.lora_A
            module, kind = plain.split(".lora_")
            plain = f"{module}.lora_{kind[0]}"
            tensor = scaling * tensor if kind[0] == "B" else tensor
        assert plain not in out, f"{name}: two tensors publish as {plain}"
        out[plain] = tensor.detach().contiguous()
    return out


def adapted_modules(state: dict[str, torch.Tensor]) -> list[str]:
    """Names of the layers a published state carries adapters for."""
    modules = sorted(name.removesuffix(".lora_A") for name in state if name.endswith(".lora_A"))
    for module in modules:
        if f"{module}.lora_B" not in state or f"{module}.weight" not in state:
            raise ValueError(f"published state has {module}.lora_A without its lora_B or base weight")
    return modules


def merge(state: dict[str, torch.Tensor], changed: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The plain model's tensors of a published state: each adapted `X.weight` becomes
    W0 + B @ A in float32, adapters dropped. With `changed` (names a delta touched), only the
    plain tensors those changes affect. A state without adapters is returned as is."""
    names = set(state if changed is None else changed)
    modules = adapted_modules(state)
    out = {name: state[name] for name in names if not name.endswith(ADAPTER_SUFFIXES)}
    for module in modules:
        if names.isdisjoint({f"{module}.weight", f"{module}.lora_A", f"{module}.lora_B"}):
            continue
        base = state[f"{module}.weight"].float()
        a, b = state[f"{module}.lora_A"], state[f"{module}.lora_B"]
        if (b.shape[0], a.shape[1]) != tuple(base.shape) or b.shape[1] != a.shape[0]:
            raise ValueError(
                f"{module}: lora_B {list(b.shape)} @ lora_A {list(a.shape)} does not fit its weight "
                f"{list(base.shape)} (only (out x in) linear weights are supported, not Conv1D)"
            )
        out[f"{module}.weight"] = torch.addmm(base, b.float(), a.float())
    return out


class AdaptersDisabled(torch.nn.Module):
    """The base model under a `peft` model, as a module of its own: the KL reference of a LoRA run
    (the frozen warm start) without a second copy of the weights."""

    def __init__(self, peft_model: Any):  # a peft.PeftModel (peft is imported lazily)
        super().__init__()
        self.peft_model = peft_model

    @property
    def config(self):
        return self.peft_model.config

    def forward(self, *args, **kwargs):
        with self.peft_model.disable_adapter():
            return self.peft_model(*args, **kwargs)

    def get_decoder(self) -> torch.nn.Module:
        """The decoder stack run with the adapters off (chunked log-probs call it, then the head)."""
        return _DecoderAdaptersDisabled(self.peft_model)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.peft_model.get_output_embeddings()  # the head carries no adapter

    def multimodal_body(self) -> torch.nn.Module:
        """A vision-language model's body (vision tower, projector, decoder) with the adapters off."""
        return _BodyAdaptersDisabled(self.peft_model)


class _DecoderAdaptersDisabled(torch.nn.Module):
    def __init__(self, peft_model: torch.nn.Module):
        super().__init__()
        self.peft_model = peft_model

    def forward(self, *args, **kwargs):
        peft_model: Any = self.peft_model  # a peft.PeftModel; torch.nn.Module does not declare these
        with peft_model.disable_adapter():
            return peft_model.get_decoder()(*args, **kwargs)


class _BodyAdaptersDisabled(_DecoderAdaptersDisabled):
    def forward(self, *args, **kwargs):
        peft_model: Any = self.peft_model
        with peft_model.disable_adapter():
            return peft_model.get_base_model().model(*args, **kwargs)


def reference_model(model: torch.nn.Module, load_warm_start) -> torch.nn.Module:
    """The frozen initial policy: the base under the adapters, or a fresh load of the warm start."""
    if _is_peft(model):
        return AdaptersDisabled(model)
    return load_warm_start().eval().requires_grad_(False)
