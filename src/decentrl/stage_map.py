"""The stage map: which contiguous decoder layers, and so which parameters, each pipeline stage holds.

A policy split into K stages is served by stage holders that each materialise one stage's tensors
(worker/stage_server.py); no participant needs the whole model. Stage 0 holds the token embedding
and the first layers; the last stage holds the last layers, the final norm and the LM head. With
tied embeddings the LM head *is* the embedding matrix, so both end stages hold that one matrix
(`model.embed_tokens.weight`): it is the only tensor two stages share.

The map is fixed for a run: it is part of the run's config, of `/v1/info` and of every weight
manifest, and a coordinator refuses a manifest or a worker whose map differs. No torch: the
coordinator and the config use this module.
"""

from __future__ import annotations

import re
from functools import cached_property

from pydantic import BaseModel, ConfigDict, Field, model_validator

from decentrl.config_error import ConfigError

LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
FIRST_STAGE_PREFIXES = ("model.embed_tokens.",)
LAST_STAGE_PREFIXES = ("model.norm.", "lm_head.")
TIED_NAME = "model.embed_tokens.weight"


class StageMapError(ConfigError):
    """A parameter name the map cannot place, or a map that does not fit the model: a user's
    mistake in `model.num_stages` / `model.stage_layers`, one line from any role."""


class StageMap(BaseModel):
    """Layer ranges `[bounds[s], bounds[s + 1])` per stage s over a model of `bounds[-1]` layers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bounds: tuple[int, ...] = Field(..., min_length=3, max_length=1025)
    """Start layer of each stage, then the number of layers: (0, 15, 30) is two stages of 15."""
    tied_embeddings: bool
    """The LM head shares the embedding matrix, which both end stages then hold."""

    @model_validator(mode="after")
    def _increasing(self) -> StageMap:
        if self.bounds[0] != 0 or any(b <= a for a, b in zip(self.bounds, self.bounds[1:], strict=False)):
            raise StageMapError(f"stage bounds must start at 0 and increase, got {list(self.bounds)}")
        return self

    @classmethod
    def even(cls, num_layers: int, num_stages: int, tied_embeddings: bool) -> StageMap:
        """K stages of near-equal layer counts (the first ones take the remainder)."""
        if not 2 <= num_stages <= num_layers:
            raise StageMapError(
                f"model.num_stages = {num_stages} needs 2 <= stages <= the model's {num_layers} layers"
            )
        size, extra = divmod(num_layers, num_stages)
        bounds = [0]
        for stage in range(num_stages):
            bounds.append(bounds[-1] + size + (stage < extra))
        return cls(bounds=tuple(bounds), tied_embeddings=tied_embeddings)

    @classmethod
    def from_layer_ranges(cls, ranges: list[list[int]], num_layers: int, tied_embeddings: bool) -> StageMap:
        """Explicit `[[0, 10], [10, 30]]` ranges: contiguous, covering every layer once."""
        bounds = [0]
        for start, end in ranges:
            if start != bounds[-1] or end <= start:
                raise StageMapError(
                    f"model.stage_layers must be contiguous [start, end) ranges from 0: {ranges}"
                )
            bounds.append(end)
        if bounds[-1] != num_layers:
            raise StageMapError(f"model.stage_layers cover {bounds[-1]} layers; the model has {num_layers}")
        return cls(bounds=tuple(bounds), tied_embeddings=tied_embeddings)

    @classmethod
    def for_model(
        cls, num_stages: int | None, stage_layers: list[list[int]] | None, model_config: dict
    ) -> StageMap | None:
        """The run's map from `model.num_stages` / `model.stage_layers` and the model's `config.json`
        (its `num_hidden_layers` and `tie_word_embeddings`); None when the run is not staged."""
        if num_stages is None and stage_layers is None:
            return None
        num_layers = int(model_config["num_hidden_layers"])
        tied = bool(model_config.get("tie_word_embeddings", False))
        if stage_layers is not None:
            return cls.from_layer_ranges(stage_layers, num_layers, tied)
        assert num_stages is not None
        return cls.even(num_layers, num_stages, tied)

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    @property
    def num_layers(self) -> int:
        return self.bounds[-1]

    @property
    def last(self) -> int:
        return self.num_stages - 1

    def layers(self, stage: int) -> range:
        self._check(stage)
        return range(self.bounds[stage], self.bounds[stage + 1])

    @cached_property
    def _stage_of_layer(self) -> dict[int, int]:
        return {layer: s for s in range(self.num_stages) for layer in self.layers(s)}

    def stages_of(self, name: str) -> tuple[int, ...]:
        """The stages that hold parameter `name` (two only for a tied embedding matrix)."""
        match = LAYER.match(name)
        if match:
            layer = int(match.group(1))
            if layer not in self._stage_of_layer:
                raise StageMapError(f"{name} names layer {layer}; the stage map covers {self.num_layers}")
            return (self._stage_of_layer[layer],)
        if name.startswith(FIRST_STAGE_PREFIXES):
            return (0, self.last) if self.tied_embeddings and name == TIED_NAME else (0,)
        if name.startswith(LAST_STAGE_PREFIXES):
            return (self.last,)
        raise StageMapError(
            f"the stage map cannot place parameter {name!r} (not an embedding, layer, norm or head)"
        )

    def names(self, stage: int, all_names: list[str] | set[str]) -> list[str]:
        """The names of `all_names` that stage `stage` holds, in sorted order."""
        self._check(stage)
        return sorted(name for name in all_names if stage in self.stages_of(name))

    def describe(self) -> str:
        return ", ".join(
            f"stage {s}: layers {r.start}-{r.stop - 1}"
            + (" + embedding" if s == 0 else "")
            + (
                " + norm, head" + (" (tied to the embedding)" if self.tied_embeddings else "")
                if s == self.last
                else ""
            )
            for s in range(self.num_stages)
            for r in [self.layers(s)]
        )

    def _check(self, stage: int) -> None:
        if not 0 <= stage < self.num_stages:
            raise StageMapError(f"stage {stage} does not exist; the run has stages 0-{self.last}")
