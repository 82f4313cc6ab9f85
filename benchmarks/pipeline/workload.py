"""What `decentrl bench pipeline` runs: the model (as a run publishes it) and the demo's prompts."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from decentrl.config import DEMO_CONFIG, load_config
from decentrl.envs import load_environment
from decentrl.envs.chat import ChatFormat
from decentrl.model.resolve import resolve_model_dir

NO_EOS = [-1]
"""An id no vocabulary has: with it as the EOS every sequence decodes its whole token budget."""


def load_model(model_dir: str | None) -> tuple[Path, PreTrainedModel, str]:
    """(its directory, the model in float32 holding bf16-exact weights as a run publishes them, its
    name); the warm-started demo model when `model_dir` is None."""
    path = resolve_model_dir(load_config(DEMO_CONFIG, []), model_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        # The parameters only: `model.to(torch.bfloat16)` would also round the rotary embedding's
        # inv_freq buffer, which no engine does (it is computed from the config, never published),
        # and the recomputed log-probs would then differ from every engine's by up to 1e-2.
        for parameter in model.parameters():
            parameter.copy_(parameter.to(torch.bfloat16))
    return path, model, "the warm-started demo model" if model_dir is None else path.name


def published_state(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The tensors an engine loads: a tied head is the embedding, so it is left out."""
    tied = bool(model.config.tie_word_embeddings)
    return {name: t for name, t in model.state_dict().items() if not (tied and name == "lm_head.weight")}


def demo_prompts(chat: ChatFormat, count: int) -> list[list[int]]:
    """`count` prompts as the demo's coordinator leases them: its task's problems (raw text, no
    chat template), each `group_size` times in a row."""
    config = load_config(DEMO_CONFIG, [])
    env = load_environment(config.task.env, **config.task.args)
    group = config.coordinator.group_size
    problems = [env.problem(seed, "train") for seed in range(math.ceil(count / group))]
    ids = [chat.prompt_ids(p.prompt, env.tools or None) for p in problems]
    return [prompt for prompt in ids for _ in range(group)][:count]
