"""The reward model on a CUDA device (skipped without one): the scorer role's batched scores on
the GPU equal the CPU's (`pytest -m gpu -s` prints the time of one batch)."""

from __future__ import annotations

import time

import pytest
import torch

from decentrl.config import ModelConfig
from decentrl.model.tiny import build_tiny, save_model_dir
from decentrl.rewards.reward_model import RewardModel, load_reward_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_batched_scores_on_cuda_equal_the_cpu_ones(tmp_path):
    model_dir = save_model_dir(*build_tiny(ModelConfig(hidden_size=128, num_heads=4)), tmp_path / "lm")
    model, tokenizer = load_reward_model(model_dir)
    model.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    prompts = [f"{a}+{b}=" for a in range(40) for b in range(0, 40, 5)]
    answers = [str(int(p[:-1].split("+")[0]) + int(p[:-1].split("+")[1])) for p in prompts]
    cpu = RewardModel(tmp_path / "rm", device="cpu", batch_size=64).score(prompts, answers)
    gpu_model = RewardModel(tmp_path / "rm", device="cuda", batch_size=64)
    started = time.perf_counter()
    gpu = gpu_model.score(prompts, answers)
    torch.cuda.synchronize()
    print(
        f"{len(prompts)} rollouts scored on {torch.cuda.get_device_name()} in {time.perf_counter() - started:.3f}s"
    )
    assert gpu == pytest.approx(cpu, abs=1e-3)
