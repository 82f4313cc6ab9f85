"""One pipeline stage of a `transformers` causal LM: only its own tensors, the model's own code.

A stage holder serves a contiguous slice of the decoder (`stage_map.py`) and must never need the
memory of the whole model. `load_stage` builds the architecture from `config.json` on the meta
device, where a parameter has a shape and a dtype but no storage, then allocates only the modules
this stage runs: stage 0 the token embedding, the last stage the final norm and the LM head (tied:
the embedding matrix), and each its own decoder layers. Everything else stays on meta, so a
30-layer model split in three costs each holder a third of the weights.

The forward pass calls the model's own modules (its decoder layers, rotary embedding and
`transformers`' mask builders), not a reimplementation of attention: chained over the stages it
computes what the whole model computes. Weights arrive later from published tensors, with LoRA
adapters served unmerged (`adapters.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_utils import slice_logits_to_keep

from decentrl.model import adapters
from decentrl.stage_map import StageMap, StageMapError

MASK_BUILDERS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
"""The attention kinds a stage builds masks for, as the Llama / Qwen2 model forwards do."""


def layer_types(config: Any) -> list[str]:
    """Each layer's attention kind; Llama configs do not list them (every layer attends fully)."""
    return getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers


class Stage:
    """Stage `stage` of `stage_map` over `model`, of which only this stage's modules are real."""

    def __init__(self, model: PreTrainedModel, stage_map: StageMap, stage: int, names: list[str]):
        self.model = model
        self.stage_map = stage_map
        self.stage = stage
        self.names = names
        """The full-model parameter names this stage loads (`stage_map.names`), adapters aside."""
        self.layers = stage_map.layers(stage)
        self.is_first, self.is_last = stage == 0, stage == stage_map.last
        self.config: Any = model.config  # a PretrainedConfig; its fields depend on the architecture
        self.decoder: Any = model.get_decoder()  # embed_tokens, layers, rotary_emb, norm
        self.layer_types: list[str] = layer_types(self.config)
        self.dtype = model.dtype
        self.device = next(p.device for p in model.parameters() if not p.is_meta)
        self.policy_version = -1
        self.loaded = False

    @property
    def materialised(self) -> frozenset[str]:
        """Names of the parameters this process allocated (adapters included), read from the model."""
        return frozenset(name for name, parameter in self.model.named_parameters() if not parameter.is_meta)

    def load_weights(self, state: dict[str, torch.Tensor], version: int = -1) -> None:
        """Every tensor of this stage (plus its layers' adapters), and nothing of another stage."""
        self._refuse_foreign(state)
        missing = sorted(set(self.names) - set(state))
        if missing:
            raise ValueError(f"stage {self.stage} weights are incomplete: missing {missing[:5]}")
        self._copy(state)
        self.policy_version, self.loaded = version, True

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int = -1) -> None:
        """Some of this stage's tensors (those a delta changed), copied in place."""
        self._refuse_foreign(tensors)
        self._copy(tensors)
        self.policy_version = version

    def _refuse_foreign(self, names: Iterable[str]) -> None:
        foreign = []
        for name in names:
            try:
                if self.stage not in self.stage_map.stages_of(name):
                    foreign.append(name)
            except StageMapError:
                foreign.append(name)
        if foreign:
            held = f"layers {self.layers.start}-{self.layers.stop - 1}"
            held += " and the embedding" * self.is_first + " and the norm and head" * self.is_last
            raise ValueError(
                f"stage {self.stage} holds {held} only; refusing tensors of other stages: {sorted(foreign)[:5]}"
            )

    @torch.no_grad()
    def _copy(self, tensors: dict[str, torch.Tensor]) -> None:
        adapters.serve(self.model, tensors)  # this stage's adapted layers gain their lora_A / lora_B
        live = dict(self.model.named_parameters())  # a tied head appears once, as the embedding
        unknown = sorted(set(tensors) - set(live))
        wrong = sorted(name for name in set(tensors) & set(live) if tensors[name].shape != live[name].shape)
        if unknown or wrong:
            raise ValueError(
                f"weights do not match stage {self.stage}: unexpected={unknown[:5]} shape={wrong[:5]}"
            )
        for name, tensor in tensors.items():
            live[name].copy_(tensor)  # casts to the stage's dtype

    def new_cache(self) -> DynamicCache:
        """A KV cache for this stage's layers.

        `transformers`' attention modules address the cache by their global `layer_idx`
        (`cache.layers[layer_idx].update(...)`), so the cache is sized to the whole model and only
        this stage's entries ever fill; the others stay empty `DynamicLayer`s, which hold no tensor.
        Its `get_seq_length()` reads layer 0, so it is 0 on every stage but the first: the masks
        are sized against this stage's first layer instead (`_masks`)."""
        return DynamicCache(config=self.config)

    @torch.no_grad()
    def forward(
        self,
        inputs: torch.Tensor,
        attention_mask_bt: torch.Tensor,
        position_ids_bt: torch.Tensor,
        cache: DynamicCache | None = None,
        logits_to_keep: int = 1,
    ) -> torch.Tensor:
        """Token ids [B, T] (stage 0) or hidden states [B, T, D] in; hidden states [B, T, D] out, or
        the last stage's logits [B, logits_to_keep, V] (0 keeps every position). Without a cache it
        is a teacher-forced pass over the whole given sequence; with one, the next T positions."""
        assert self.loaded, f"stage {self.stage}: load_weights before forward"
        if self.is_first:
            assert inputs.ndim == 2 and inputs.dtype == torch.long, "stage 0 takes token ids [B, T]"
        else:
            assert inputs.ndim == 3 and inputs.shape[-1] == self.config.hidden_size, list(inputs.shape)
        hidden_btd = self.run(inputs, attention_mask_bt, position_ids_bt, cache)
        if not self.is_last:
            return hidden_btd
        head: Any = self.model.get_output_embeddings()  # looked up each time: `adapters.serve` may swap it
        return head(slice_logits_to_keep(hidden_btd, logits_to_keep))

    def run(
        self,
        inputs: torch.Tensor,
        attention_mask_bt: torch.Tensor,
        position_ids_bt: torch.Tensor,
        cache: DynamicCache | None = None,
    ) -> torch.Tensor:
        """This stage's modules on `inputs` (token ids on stage 0, hidden states elsewhere), as the
        model's own forward runs them: the embedding, the layers, the last stage's final norm (not
        its head). Differentiable: a stage trainer (`trainer/stage_model.py`) trains through it."""
        if self.is_first:
            hidden_btd = self.decoder.embed_tokens(inputs.to(self.device))
        else:
            hidden_btd = inputs.to(self.device, self.dtype)
        attention_mask_bt = attention_mask_bt.to(self.device)
        position_ids_bt = position_ids_bt.to(self.device)
        masks = self._masks(hidden_btd, attention_mask_bt, position_ids_bt, cache)
        position_embeddings = self.decoder.rotary_emb(hidden_btd, position_ids_bt)
        for index in self.layers:
            hidden_btd = self.decoder.layers[index](
                hidden_btd,
                attention_mask=masks[self.layer_types[index]],
                position_embeddings=position_embeddings,
                position_ids=position_ids_bt,
                cache=cache,
                use_cache=cache is not None,
            )
        return self.decoder.norm(hidden_btd) if self.is_last else hidden_btd

    def _masks(
        self,
        hidden_btd: torch.Tensor,
        attention_mask_bt: torch.Tensor,
        position_ids_bt: torch.Tensor,
        cache: DynamicCache | None,
    ) -> dict[str, Any]:
        """One mask per attention kind of this stage's layers, as the model's forward builds them,
        but sized against this stage's first layer of that kind: the model's default, layer 0 of
        the cache, is empty on any later stage and would give a mask of the new positions only."""
        masks = {}
        for kind in sorted({self.layer_types[index] for index in self.layers}):
            masks[kind] = MASK_BUILDERS[kind](
                config=self.config,
                inputs_embeds=hidden_btd,
                attention_mask=attention_mask_bt,
                cache=cache,
                position_ids=position_ids_bt,
                layer_idx=next(index for index in self.layers if self.layer_types[index] == kind),
            )
        return masks


def meta_model(model_dir: Path, stage_map: StageMap, dtype: str = "float32") -> PreTrainedModel:
    """The architecture of `model_dir` (only `config.json` is read) on the meta device: shapes
    and dtypes, no storage; refused when `stage_map` does not fit it or its attention kinds."""
    config = AutoConfig.from_pretrained(model_dir)
    if (stage_map.num_layers, stage_map.tied_embeddings) != (
        config.num_hidden_layers,
        config.tie_word_embeddings,
    ):
        raise StageMapError(
            f"the stage map ({stage_map.num_layers} layers, tied={stage_map.tied_embeddings}) does not fit "
            f"{model_dir} ({config.num_hidden_layers} layers, tied={config.tie_word_embeddings})"
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    kinds = set(layer_types(model.config))
    if not kinds <= set(MASK_BUILDERS):
        raise ValueError(
            f"pipeline stages serve {sorted(MASK_BUILDERS)} layers; this model has {sorted(kinds)}"
        )
    return model


def materialise(model: Any, stage_map: StageMap, stage: int, device: str = "cpu") -> None:
    """Allocate (zeroed) the modules stage `stage` runs, adapters inside its layers included, and
    leave every other one on meta. `model` is a causal LM from `meta_model`, possibly under a
    `peft` wrapper (whose `get_decoder` reaches the same modules)."""
    decoder: Any = model.get_decoder()
    modules = [decoder.layers[index] for index in stage_map.layers(stage)]
    if stage == 0 or (stage == stage_map.last and stage_map.tied_embeddings):
        modules.append(decoder.embed_tokens)
    if stage == stage_map.last:
        modules.append(decoder.norm)
        if not stage_map.tied_embeddings:
            modules.append(model.get_output_embeddings())
    with torch.no_grad():
        for module in modules:
            module.to_empty(device=device)
            for parameter in module.parameters():
                parameter.zero_()
    if stage == stage_map.last and stage_map.tied_embeddings:
        # to_empty gives the embedding a new parameter; the head must compute with that one
        model.get_output_embeddings().weight = decoder.embed_tokens.weight
    # The rotary embedding has no weights but real buffers (inv_freq, computed from the config):
    # the model's own class, built on the stage's device, computes them as the whole model does.
    with torch.device(device):
        decoder.rotary_emb = type(decoder.rotary_emb)(config=decoder.config)


def load_stage(
    model_dir: Path, stage_map: StageMap, stage: int, dtype: str = "float32", device: str = "cpu"
) -> Stage:
    """Stage `stage` of the model in `model_dir` (only `config.json` is read), zero until loaded."""
    model = meta_model(model_dir, stage_map, dtype)
    names = stage_map.names(stage, [name for name, _ in model.named_parameters()])
    materialise(model, stage_map, stage, device)
    return Stage(model.eval().requires_grad_(False), stage_map, stage, names)
