"""Every algorithm variant, chosen from TOML, runs a real training step on the tiny model."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from decentrl.config import ModelConfig, TrainerConfig, load_config
from decentrl.engines.hf import HFEngine
from decentrl.model.tiny import build_tiny
from decentrl.protocol import SamplingParams, Segment, TrainGroup, TrainRollout
from decentrl.trainer.batch import collate
from decentrl.trainer.step import Algorithm, train_step

VARIANTS = {
    "advantage": [
        'name = "grpo"',
        'name = "dr_grpo"',
        'name = "rloo"',
        'name = "reinforce_pp"\nbaseline = true',
    ],
    "loss": [
        'name = "ppo_clip"\ndual_clip = 3.0',
        'name = "dapo"\noverlong_buffer_tokens = 2',
        'name = "gspo"',
        'name = "cispo"',
    ],
    "correction": [
        'name = "none"',
        'name = "decoupled"',
        'name = "tis"\nlevel = "sequence"',
        'name = "mis"\nlevel = "token"',
        'name = "icepop"',
        'name = "m2po"',
    ],
}
CASES = [(kind, body) for kind, bodies in VARIANTS.items() for body in bodies] + [
    ("algorithm", 'kl_coef = 0.1\nkl_estimator = "k2"\nentropy_coef = 0.01\naggregation = "constant"'),
    ("algorithm", 'kl_coef = 0.1\nkl_estimator = "k3"\naggregation = "sequence_mean"'),
]


@pytest.fixture(scope="module")
def setup():
    """Four groups of four completions really sampled from the tiny model, rewarded 1/0
    alternately (the last group all 0), with the behaviour log-probs perturbed as a stale worker's would be."""
    torch.manual_seed(0)
    model, tokenizer = build_tiny(ModelConfig())
    engine = HFEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id, "cpu")
    engine.load_weights(model.state_dict(), 3)
    prompts = [tokenizer.encode(text) for text in ("12+3=", "4+56=", "7+8=", "90+1=")]
    completions = engine.generate(
        [p for p in prompts for _ in range(4)], SamplingParams(max_new_tokens=5), seed=1
    )
    generator = torch.Generator().manual_seed(0)
    groups = []
    for g, prompt in enumerate(prompts):
        rollouts = []
        for i in range(4):
            c = completions[4 * g + i]
            noisy = (
                torch.tensor(c.logprobs) + 0.3 * torch.randn(len(c.logprobs), generator=generator)
            ).tolist()
            segment = Segment(
                source="model", token_ids=c.token_ids, logprobs=noisy, policy_versions=c.policy_versions
            )
            reward = float(i % 2 == 0) if g < 3 else 0.0  # the last group: all equal
            rollouts.append(
                TrainRollout(
                    rollout_id=f"{g}-{i}",
                    worker_id="w",
                    prompt_token_ids=prompt,
                    segments=[segment],
                    finish_reason=c.finish_reason,
                    reward=reward,
                )
            )
        groups.append(TrainGroup(group_id=str(g), task_id=str(g), rollouts=rollouts))
    return model, tokenizer, groups


@pytest.mark.parametrize(("kind", "body"), CASES, ids=[f"{k}:{b.splitlines()[0]}" for k, b in CASES])
def test_variant_from_toml_trains_one_step(setup, tmp_path: Path, kind: str, body: str) -> None:
    model, tokenizer, groups = setup
    section = "[algorithm]" if kind == "algorithm" else f"[algorithm.{kind}]"
    path = tmp_path / "run.toml"
    path.write_text(f"{section}\n{body}\n")
    config = load_config(path)
    algorithm = Algorithm.from_config(config.algorithm)
    assert type(algorithm.loss).__module__.startswith("decentrl.algo.losses")

    model = copy.deepcopy(model).train()
    reference = copy.deepcopy(model).eval() if config.algorithm.kl_coef > 0 else None
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer_config = TrainerConfig(lr=1e-3, lr_warmup_steps=0)

    def shaping(rewards_b, lengths_b):
        return algorithm.loss.shape_rewards(rewards_b, lengths_b, 5)

    batch = collate(groups, tokenizer.pad_token_id, algorithm.advantage, shaping)
    metrics = train_step(model, optimizer, batch, algorithm, trainer_config, 1.0, 5, 5, reference)

    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    for key in (
        "loss",
        "clip_fraction",
        "is_weight_mean",
        "is_weight_max",
        "is_ess_fraction",
        "mismatch_kl",
        "entropy",
        "grad_norm",
        "staleness_mean",
    ):
        assert key in metrics, key
    assert metrics["grad_norm"] > 0
    assert metrics["staleness_mean"] == 2.0  # sampled at version 3, trained at 5
    assert metrics["staleness_frac_2"] == 1.0
    if config.algorithm.kl_coef > 0:
        assert "kl_reference" in metrics
    changed = sum(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(), strict=True))
    assert changed > 0


def test_lora_step_trains_only_adapters_and_its_delta_is_adapter_sized(setup) -> None:
    """With lora.rank = 2 one real step changes no base weight (bit for bit), only adapters; the
    published bf16 delta then leaves every base tensor `same` and costs a few % of a snapshot."""
    from decentrl.config import LoraConfig
    from decentrl.model import lora
    from decentrl.weights.codec import encode_state, published_state

    base, tokenizer, groups = setup
    model = lora.attach(copy.deepcopy(base), LoraConfig(rank=2)).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert 0 < sum(p.numel() for p in trainable) < 0.03 * sum(p.numel() for p in model.parameters())
    before = published_state(lora.publication_state(model), "bfloat16")
    algorithm = Algorithm.from_config(load_config(None, ["algorithm.kl_coef=0.1"]).algorithm)
    batch = collate(groups, tokenizer.pad_token_id, algorithm.advantage, lambda r, n: r)
    optimizer = torch.optim.AdamW(trainable, lr=1e-3, weight_decay=0.0)
    reference = lora.reference_model(model, load_warm_start=lambda: pytest.fail("a second copy"))
    # One optimizer step, so that the reference KL is taken where B is still exactly zero.
    trainer_config = TrainerConfig(lr=1e-3, lr_warmup_steps=0, minibatches_per_version=1)
    metrics = train_step(model, optimizer, batch, algorithm, trainer_config, 1.0, 5, 5, reference)
    assert abs(metrics["kl_reference"]) < 1e-6  # B = 0: the policy still is its reference
    after = published_state(lora.publication_state(model), "bfloat16")
    moved = copy.deepcopy(model)
    again = train_step(
        moved,
        torch.optim.AdamW([p for p in moved.parameters() if p.requires_grad], lr=1e-3),
        batch,
        algorithm,
        trainer_config,
        1.0,
        6,
        5,
        lora.reference_model(moved, None),
    )
    assert again["kl_reference"] > 1e-6  # one step later the adapters have moved it away

    assert before.keys() == after.keys()
    changed = {name for name in after if not torch.equal(before[name], after[name])}
    adapters = {name for name in after if name.endswith((".lora_A", ".lora_B"))}
    # B starts at zero, so the first step moves every B and (no gradient through B = 0) no A.
    assert changed == {name for name in adapters if name.endswith(".lora_B")}
    entries, payload = encode_state(before, after)
    assert {e.name for e in entries if e.encoding != "same"} == changed
    snapshot_bytes = sum(t.numel() * t.element_size() for t in after.values())
    assert len(payload) / snapshot_bytes < 0.03


def _train(
    setup, loss_body: str, sgd: bool = False, checkpointing: bool = False, **trainer
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Final parameters and metrics of one version with the loss `loss_body`, from the same start."""
    model, tokenizer, groups = setup
    model = copy.deepcopy(model)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    algorithm = Algorithm.from_config(load_config(None, [f"algorithm.loss={{{loss_body}}}"]).algorithm)
    batch = collate(groups, tokenizer.pad_token_id, algorithm.advantage, lambda r, n: r)
    # SGD moves each weight by lr x its gradient; Adam's first step is about lr x sign(gradient),
    # which turns float noise in a near-zero gradient into a full step.
    optimizer = (torch.optim.SGD if sgd else torch.optim.AdamW)(model.parameters(), lr=1e-2)
    config = TrainerConfig(lr=1e-2, lr_warmup_steps=0, **trainer)
    metrics = train_step(model, optimizer, batch, algorithm, config, 1.0, 5, 5)
    return [p.detach().clone() for p in model.parameters()], metrics


LOSSES = {"ppo_clip": 'name = "ppo_clip"', "dapo": 'name = "dapo"', "cispo": 'name = "cispo"'}


def test_several_minibatches_make_the_clip_act_and_the_losses_differ(setup) -> None:
    """With one step per version pi_theta = pi_prox where the gradient is taken: PPO-clip, DAPO
    (clip-higher) and CISPO give the same update and nothing is clipped. With four mini-batches
    the later steps see ratios away from 1, the clips act, and the three updates differ."""
    single = {name: _train(setup, body, minibatches_per_version=1) for name, body in LOSSES.items()}
    for params, metrics in single.values():
        assert metrics["clip_fraction"] == 0.0 and metrics["num_minibatches"] == 1
        for a, b in zip(params, single["ppo_clip"][0], strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)

    several = {name: _train(setup, body, minibatches_per_version=4) for name, body in LOSSES.items()}
    for name, (_, metrics) in several.items():
        assert metrics["num_minibatches"] == 4
        assert metrics["clip_fraction"] > 0.01, (name, metrics["clip_fraction"])
    for first, second in [("ppo_clip", "dapo"), ("ppo_clip", "cispo"), ("dapo", "cispo")]:
        gap = max(
            float((a - b).abs().max()) for a, b in zip(several[first][0], several[second][0], strict=True)
        )
        assert gap > 1e-4, (first, second, gap)


def test_micro_batch_split_does_not_change_the_update(setup) -> None:
    whole, whole_metrics = _train(
        setup, LOSSES["ppo_clip"], sgd=True, minibatches_per_version=2, micro_batch_tokens=10**6
    )
    split, split_metrics = _train(
        setup, LOSSES["ppo_clip"], sgd=True, minibatches_per_version=2, micro_batch_tokens=1
    )
    for a, b in zip(whole, split, strict=True):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=0)
    assert split_metrics["loss"] == pytest.approx(whole_metrics["loss"], abs=1e-6)
    assert split_metrics["clip_fraction"] == pytest.approx(whole_metrics["clip_fraction"], abs=1e-9)


def test_gradient_checkpointing_does_not_change_the_update(setup) -> None:
    plain, _ = _train(setup, LOSSES["ppo_clip"], sgd=True, minibatches_per_version=2)
    recomputed, _ = _train(setup, LOSSES["ppo_clip"], sgd=True, checkpointing=True, minibatches_per_version=2)
    for a, b in zip(plain, recomputed, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_bf16_parameters_step_fp32_master_weights(setup) -> None:
    """bf16 model, fp32 master copies and AdamW state: the parameters are the rounded masters."""
    from decentrl.trainer.master_weights import MasterWeights

    model, tokenizer, groups = setup
    model = copy.deepcopy(model).to(torch.bfloat16)
    master = MasterWeights(model)
    optimizer = torch.optim.AdamW(master.parameters(), lr=1e-3)
    algorithm = Algorithm.from_config(load_config(None).algorithm)
    batch = collate(groups, tokenizer.pad_token_id, algorithm.advantage, lambda r, n: r)
    before = {name: t.clone() for name, t in master.state().items()}
    config = TrainerConfig(lr=1e-3, lr_warmup_steps=0, minibatches_per_version=2)
    metrics = train_step(model, optimizer, batch, algorithm, config, 1.0, 5, 5, master=master)
    assert metrics["grad_norm"] > 0
    state = master.state()
    assert all(t.dtype == torch.float32 for t in state.values())
    assert any(not torch.equal(before[name], state[name]) for name in state)
    for moments in optimizer.state.values():
        assert moments["exp_avg"].dtype == moments["exp_avg_sq"].dtype == torch.float32
    for name, param in model.named_parameters():
        assert param.dtype == torch.bfloat16 and param.grad is None
        assert torch.equal(param, state[name].to(torch.bfloat16))


class RecordingSGD(torch.optim.SGD):
    """Plain SGD that keeps a copy of the gradients it is asked to step with."""

    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's signature
        self.seen = [p.grad.clone() for p in self.param_groups[0]["params"]]
        return super().step(closure)


def test_bf16_gradients_accumulate_in_fp32_over_micro_batches(setup) -> None:
    """16 micro-batches of one row each: the master gradient is the fp32 sum of the 16 bf16
    micro-batch gradients, not their running sum rounded to bf16 after every addition."""
    from decentrl.trainer.batch import micro_batch_rows
    from decentrl.trainer.master_weights import MasterWeights
    from decentrl.trainer.step import BatchCounts, apply_correction, minibatch_update, policy_loss, score

    model, tokenizer, groups = setup
    model = copy.deepcopy(model).to(torch.bfloat16)
    algorithm = Algorithm.from_config(load_config(None).algorithm)
    batch = collate(groups, tokenizer.pad_token_id, algorithm.advantage, lambda r, n: r)
    config = TrainerConfig(micro_batch_tokens=1, max_grad_norm=1e9)  # one row per pass, no clipping
    apply_correction(batch, *score(model, batch, 1.0, config.micro_batch_tokens), algorithm)
    counts = BatchCounts(
        num_loss_tokens=batch.num_loss_tokens, num_sequences=batch.num_rows, max_new_tokens=5
    )
    micro_batches = micro_batch_rows(batch, list(range(batch.num_rows)), config.micro_batch_tokens)
    assert len(micro_batches) == 16
    master = MasterWeights(model)
    expected = [torch.zeros_like(p) for p in master.parameters()]
    model.train()
    for rows in micro_batches:
        loss, _ = policy_loss(model, batch.select(rows), algorithm, 1.0, counts)
        loss.backward()
        for total, (_, param) in zip(expected, master.named, strict=True):
            total += param.grad.float()
            param.grad = None
    optimizer = RecordingSGD(master.parameters(), lr=0.0)
    minibatch_update(model, optimizer, master, batch, algorithm, config, 1.0, counts)
    for (name, _), seen, total in zip(master.named, optimizer.seen, expected, strict=True):
        assert seen.dtype == torch.float32
        # fp32 sums in one order (or another: 1e-5); a bf16 running sum is off by ~1e-2
        torch.testing.assert_close(seen, total, rtol=1e-5, atol=1e-9, msg=lambda text, n=name: f"{n}: {text}")


def test_version_schedule_repeats_the_minibatches_per_epoch() -> None:
    from decentrl.trainer.batch import version_schedule

    assert version_schedule(6, 3, 2) == [[0, 1], [2, 3], [4, 5], [0, 1], [2, 3], [4, 5]]
    assert version_schedule(5, 2, 1) == [[0, 1], [2, 3, 4]]
    assert version_schedule(2, 4, 3) == [[0], [1], [0], [1], [0], [1]]


def test_two_epochs_are_the_same_update_as_the_batch_twice(setup) -> None:
    """Two passes of two mini-batches over a batch = one pass of four mini-batches over the batch
    repeated: the same four AdamW steps on the same halves, clipped around the same pi_prox (the
    start of the version, not the policy after the first pass)."""
    model, tokenizer, groups = setup
    results = []
    for train_groups, epochs, minibatches in ((groups, 2, 2), (groups + groups, 1, 4)):
        trained = copy.deepcopy(model)
        algorithm = Algorithm.from_config(load_config(None).algorithm)
        batch = collate(train_groups, tokenizer.pad_token_id, algorithm.advantage, lambda r, n: r)
        optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-2)
        config = TrainerConfig(lr=1e-2, lr_warmup_steps=0, epochs=epochs, minibatches_per_version=minibatches)
        metrics = train_step(trained, optimizer, batch, algorithm, config, 1.0, 5, 5)
        assert metrics["num_minibatches"] == 4
        assert all(int(state["step"]) == 4 for state in optimizer.state.values())
        results.append(([p.detach().clone() for p in trained.parameters()], metrics))
    (twice, twice_metrics), (repeated, repeated_metrics) = results
    for a, b in zip(twice, repeated, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert twice_metrics["clip_fraction"] == pytest.approx(repeated_metrics["clip_fraction"], abs=1e-9)
    assert twice_metrics["clip_fraction"] > 0.01  # the second pass is clipped around the old pi_prox
    # ...and differs from a single pass
    once, _ = _train(setup, LOSSES["ppo_clip"], minibatches_per_version=2)
    assert max(float((a - b).abs().max()) for a, b in zip(once, twice, strict=True)) > 1e-4
