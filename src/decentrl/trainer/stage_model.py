"""One pipeline stage of the policy as its stage trainer holds it: trainable, and nothing more.

A stage trainer (`trainer.pipeline_stages = K`, one rank per stage) must never allocate another
stage's tensors. `load_stage_model` builds the architecture from `config.json` on the meta device
(`model/stages.py:meta_model`), wraps it with `peft` adapters when `lora.rank > 0` (on meta too:
nothing is allocated), then materialises only this stage's modules (`materialise`: its decoder
layers with their adapters, stage 0's embedding, the last stage's norm and head, and with tied
embeddings that one matrix at both ends), and reads from the model directory's safetensors only
the tensors this stage holds. Every other parameter stays on meta and out of the optimizer.

Adapters start as `peft` starts them (A Kaiming-uniform, B zero), but each A from a generator
seeded by the run's seed and the adapter's published name (`initial_adapters`), not from the
global random stream in module order: a stage then starts from the same adapters whatever the
number of stages, and a test can give the one-process trainer the very same start.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open
from transformers import PreTrainedModel

from decentrl.algo.logprobs import LOGIT_TRANSFORMS
from decentrl.config import LoraConfig
from decentrl.model import lora
from decentrl.model.stages import Stage, materialise, meta_model
from decentrl.stage_map import StageMap

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def published_name(name: str) -> str:
    """A parameter's name as published (`model/lora.py`'s layout), from its name in the live model."""
    plain = name.removeprefix(lora.PEFT_PREFIX).replace(".base_layer.", ".")
    if ".lora_A." in plain or ".lora_B." in plain:  # X.lora_A.<adapter>.weight -> X.lora_A
        module, kind = plain.split(".lora_")
        plain = f"{module}.lora_{kind[0]}"
    return plain


@dataclass
class StageModel:
    """Stage `stage.stage` of the policy: the (possibly `peft`-wrapped) model with only this
    stage's modules real, and the compute of those modules (`stage.run`)."""

    model: torch.nn.Module
    stage: Stage
    lora_scaling: float | None
    """alpha / rank with LoRA (B is published scaled by it), None for full-parameter training."""
    trainable_order: list[str] = field(default_factory=list)
    """Published names of every trainable parameter of the *whole* model, in the one-process
    trainer's order (`named_parameters`): the gradient norm is taken over them in that order."""

    @property
    def stage_map(self) -> StageMap:
        return self.stage.stage_map

    @property
    def index(self) -> int:
        return self.stage.stage

    def named_trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        """This stage's trainable parameters by published name, in model order."""
        return [
            (published_name(name), parameter)
            for name, parameter in self.model.named_parameters()
            if parameter.requires_grad and not parameter.is_meta
        ]

    def state(self) -> dict[str, torch.Tensor]:
        """This stage's tensors in the published layout (base under plain names, each adapter's A
        and scaled B), detached: what its stage trainer publishes and checkpoints. A tied head is
        the embedding and appears once, as `model.embed_tokens.weight`."""
        state = {}
        for name, parameter in self.model.named_parameters():  # a tied head is listed once
            if parameter.is_meta:
                continue  # another stage's
            plain = published_name(name)
            tensor = parameter
            if plain.endswith(".lora_B") and self.lora_scaling is not None:
                tensor = self.lora_scaling * parameter
            state[plain] = tensor.detach().contiguous()
        return state

    @torch.no_grad()
    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """The inverse of `state`: every tensor of this stage, B unscaled (a checkpoint's or a
        published version's)."""
        live = {published_name(name): p for name, p in self.model.named_parameters() if not p.is_meta}
        missing, unexpected = sorted(set(live) - set(state)), sorted(set(state) - set(live))
        if missing or unexpected:
            raise ValueError(
                f"stage {self.index} state does not fit the stage (missing {missing[:3]}, unexpected "
                f"{unexpected[:3]}); resume with the settings it was written with (model, lora)"
            )
        for name, parameter in live.items():
            tensor = state[name]
            if name.endswith(".lora_B") and self.lora_scaling is not None:
                tensor = tensor / self.lora_scaling
            parameter.copy_(tensor)


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Which safetensors file of `model_dir` holds each tensor."""
    index = model_dir / WEIGHTS_INDEX
    if index.is_file():
        mapping = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in mapping.items()}
    single = model_dir / WEIGHTS_FILE
    if not single.is_file():
        raise FileNotFoundError(f"{model_dir} has no {WEIGHTS_FILE} (nor {WEIGHTS_INDEX})")
    with safe_open(str(single), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), single)


@torch.no_grad()
def _read_base(model: torch.nn.Module, model_dir: Path) -> None:
    """Copy from `model_dir` every base tensor this stage materialised, reading no other."""
    files = _weight_files(model_dir)
    wanted: dict[Path, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, parameter in model.named_parameters():
        plain = published_name(name)
        if parameter.is_meta or plain.endswith(lora.ADAPTER_SUFFIXES):
            continue
        if plain not in files:
            raise ValueError(f"{model_dir} does not hold {plain}, which this stage needs")
        wanted.setdefault(files[plain], []).append((plain, parameter))
    for path, pairs in wanted.items():
        with safe_open(str(path), framework="pt") as handle:
            for plain, parameter in pairs:
                parameter.copy_(handle.get_tensor(plain))


@torch.no_grad()
def initial_adapters(model: torch.nn.Module, seed: int) -> None:
    """Every materialised adapter as `peft` initialises it (A Kaiming-uniform with a = sqrt(5),
    B zero), A drawn from a generator seeded by `seed` and its published name."""
    for name, parameter in model.named_parameters():
        if parameter.is_meta:
            continue
        plain = published_name(name)
        if plain.endswith(".lora_B"):
            parameter.zero_()
        elif plain.endswith(".lora_A"):
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(plain.encode()))
            bound = 1 / math.sqrt(parameter.shape[1])  # kaiming_uniform_(a=sqrt(5)) on (rank, in)
            values = torch.rand(parameter.shape, generator=generator, dtype=torch.float64)
            parameter.copy_((2 * values - 1) * bound)


def load_stage_model(
    model_dir: Path,
    stage_map: StageMap,
    stage: int,
    lora_config: LoraConfig,
    seed: int,
    device: str = "cpu",
) -> StageModel:
    """Stage `stage` of the policy in `model_dir`, trainable in fp32 (with LoRA: its adapters
    over its frozen base), with no other stage's tensor allocated."""
    model: Any = meta_model(model_dir, stage_map, "float32")
    if any(getattr(model.config, name, None) not in (None, 1, 1.0) for name in LOGIT_TRANSFORMS):
        raise ValueError(
            "stage trainers compute log-probs from the head's output; this architecture transforms "
            "its logits (soft cap or scale): train it with trainer.pipeline_stages = 1"
        )
    trainable_full = lora.attach(model, lora_config)
    order = [published_name(name) for name, p in trainable_full.named_parameters() if p.requires_grad]
    materialise(trainable_full, stage_map, stage, device)
    for parameter in trainable_full.parameters():
        if parameter.is_meta:  # another stage's: never trained, never stepped, never allocated
            parameter.requires_grad_(False)
    _read_base(trainable_full, model_dir)
    initial_adapters(trainable_full, seed)
    names = stage_map.names(stage, [published_name(name) for name, _ in model.named_parameters()])
    scaling = lora_config.alpha / lora_config.rank if lora_config.rank > 0 else None
    # with LoRA a peft model, which passes what Stage reads through to the model it wraps
    stage_view = Stage(cast(PreTrainedModel, trainable_full), stage_map, stage, names)
    return StageModel(trainable_full, stage_view, scaling, order)
