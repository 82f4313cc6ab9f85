"""The trainer on a CUDA device in bf16 (skipped without one): `configs/real-cpu.toml` as
shipped, and a Qwen2.5-0.5B-shaped model (151,936-token vocabulary) on 2k-token sequences.
Each test prints its peak GPU memory (`pytest -m gpu -s`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from decentrl.config import load_config
from decentrl.model import lora
from decentrl.model.precision import Precision
from decentrl.model.tiny import build_tiny
from decentrl.trainer.batch import TrainTensors
from decentrl.trainer.master_weights import MasterWeights
from decentrl.trainer.step import Algorithm, train_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
REAL_CPU = Path(__file__).parents[2] / "configs" / "real-cpu.toml"


def synthetic_batch(vocab: int, rows: int, prompt: int, completion: int) -> TrainTensors:
    """Rows of random tokens, a prompt then sampled tokens with plausible behaviour log-probs,
    alternate rewards: enough to drive a real step (the tokens' meaning does not matter here)."""
    generator = torch.Generator().manual_seed(0)
    width = prompt + completion
    ids = torch.randint(3, vocab, (rows, width), generator=generator)
    loss_mask = torch.zeros((rows, width), dtype=torch.bool)
    loss_mask[:, prompt:] = True
    rewards = (torch.arange(rows) % 2).float()
    return TrainTensors(
        input_ids_bt=ids,
        attention_mask_bt=torch.ones_like(ids),
        loss_mask_bt=loss_mask,
        behaviour_logprobs_bt=torch.where(loss_mask, -torch.log(torch.tensor(float(vocab))), 0.0),
        policy_versions_bt=torch.where(loss_mask, 0, -1),
        advantages_bt=(rewards - rewards.mean())[:, None].expand(rows, width).clone(),
        rewards_b=rewards,
    )


def report(name: str, metrics: dict[str, float]) -> float:
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(
        f"\n{name}: peak GPU memory {peak:.2f} GiB, loss {metrics['loss']:.4f}, "
        f"grad norm {metrics['grad_norm']:.3f}, clip fraction {metrics['clip_fraction']:.3f}"
    )
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    return peak


def test_real_cpu_config_steps_in_bf16() -> None:
    config = load_config(REAL_CPU, ["trainer.device='cuda'"])
    precision = Precision.from_config(config.trainer)
    assert precision.device.type == "cuda" and precision.dtype == torch.bfloat16
    model, tokenizer = build_tiny(config.model)
    model = lora.attach(model.to(precision.device, precision.dtype), config.lora)
    master = MasterWeights(model)
    optimizer = torch.optim.AdamW(master.parameters(), lr=config.trainer.lr)
    algorithm = Algorithm.from_config(config.algorithm)
    rows = config.trainer.groups_per_step * config.coordinator.group_size
    batch = synthetic_batch(len(tokenizer), rows, prompt=16, completion=config.coordinator.max_new_tokens)
    torch.cuda.reset_peak_memory_stats()
    metrics = train_step(model, optimizer, batch, algorithm, config.trainer, 1.0, 0, 6, master=master)
    report("real-cpu config, bf16 + LoRA", metrics)
    assert metrics["num_minibatches"] == config.trainer.minibatches_per_version
    assert all(p.dtype == torch.float32 for p in master.parameters())
    for moments in optimizer.state.values():
        assert moments["exp_avg"].dtype == torch.float32


def test_half_billion_model_152k_vocab_2k_tokens_bf16_with_master_weights() -> None:
    """Qwen2.5-0.5B's shape (random weights), full-parameter, bf16 parameters with fp32 master
    weights and AdamW state, gradient checkpointing, 8 sequences of 2,048 tokens in micro-batches
    of 8,192 tokens, two optimizer steps."""
    torch.manual_seed(0)
    shape = Qwen2Config(
        vocab_size=151_936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    config = load_config(
        None,
        [
            "trainer.device='cuda'",
            "trainer.minibatches_per_version=2",
            "trainer.micro_batch_tokens=8192",
            "trainer.gradient_checkpointing=true",
        ],
    )
    precision = Precision.from_config(config.trainer)
    model = Qwen2ForCausalLM(shape).to(precision.device, precision.dtype)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    master = MasterWeights(model)
    assert master.separate
    optimizer = torch.optim.AdamW(master.parameters(), lr=1e-5)
    algorithm = Algorithm.from_config(config.algorithm)
    batch = synthetic_batch(shape.vocab_size, rows=8, prompt=256, completion=1792)
    torch.cuda.reset_peak_memory_stats()
    metrics = train_step(model, optimizer, batch, algorithm, config.trainer, 1.0, 0, 1792, master=master)
    peak = report("Qwen2.5-0.5B shape, 8 x 2048 tokens", metrics)
    # bf16 weights 0.99 GB + fp32 masters 1.98 GB + AdamW 3.95 GB + gradients: ~8 GiB before
    # activations; one fp32 [8, 2048, 151936] logits tensor alone would be 9.3 GiB more.
    assert peak < 16
    for name, param in model.named_parameters():
        assert param.dtype == torch.bfloat16
        assert torch.equal(param.detach().cpu(), master.state()[name].to(torch.bfloat16)), name
