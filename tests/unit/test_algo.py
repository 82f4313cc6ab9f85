"""Loss, advantage and log-prob math against numbers worked out by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from decentrl.algo.advantages import grpo_advantages
from decentrl.algo.logprobs import logprobs_from_logits, sequence_logprobs
from decentrl.algo.losses import decoupled_ppo_loss
from decentrl.config import ModelConfig
from decentrl.engines.hf import HFEngine
from decentrl.model.tiny import build_tiny
from decentrl.protocol import SamplingParams

# ---------------------------------------------------------------- GRPO advantages


def test_grpo_advantages_two_right_two_wrong() -> None:
    # mean 0.5; unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.5773503; A = ±0.5 / 0.5773503 = ±0.8660254
    advantages = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    expected = torch.tensor([0.8660254, -0.8660254, -0.8660254, 0.8660254])
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)


def test_grpo_advantages_identical_rewards_are_exact_zeros() -> None:
    advantages = grpo_advantages(torch.tensor([0.7, 0.7, 0.7]))
    assert not torch.isnan(advantages).any()
    assert torch.equal(advantages, torch.zeros(3))


def test_grpo_advantages_two_samples() -> None:
    # rewards [3, 1]: mean 2, unbiased std = sqrt((1 + 1) / 1) = 1.4142136; A = ±1 / 1.4142136 = ±0.7071068
    advantages = grpo_advantages(torch.tensor([3.0, 1.0]))
    torch.testing.assert_close(advantages, torch.tensor([0.7071068, -0.7071068]), atol=1e-5, rtol=0)


# ---------------------------------------------------------------- decoupled PPO loss

CLIP_EPS = 0.2
IS_CAP = 2.0
# Six tokens in a 2x3 batch. Per token: u = pi/pi_prox, rho = pi_prox/mu, advantage A, loss mask.
#   (0,0) plain:             u=1.1, rho=1,   A=1,  w=1   -> l = -1.1*1           = -1.1  (unclipped)
#   (0,1) clipped, A>0:      u=1.5, rho=1,   A=2,  w=1   -> min(3.0, 1.2*2=2.4)  -> l = -2.4 (clipped)
#   (0,2) MASKED:            u=e^3, rho=e^4, A=5   (would dominate everything if it leaked in)
#   (1,0) clipped, A<0:      u=0.5, rho=1,   A=-1, w=1   -> min(-0.5, 0.8*-1)    -> l = +0.8 (clipped)
#   (1,1) IS truncated:      u=1.0, rho=3,   A=0.5, w=min(3,2)=2 -> l = -2*0.5   = -1.0  (unclipped)
#   (1,2) IS < 1:            u=0.9, rho=0.5, A=-2, w=0.5 -> min(-1.8, 0.9*-2)    -> l = -0.5*-1.8 = +0.9
# sum = -1.1 - 2.4 + 0.8 - 1.0 + 0.9 = -2.8 over 5 loss tokens -> loss = -0.56
RATIO = [[1.1, 1.5, math.e**3], [0.5, 1.0, 0.9]]
RHO = [[1.0, 1.0, math.e**4], [1.0, 3.0, 0.5]]
ADVANTAGES = [[1.0, 2.0, 5.0], [-1.0, 0.5, -2.0]]
MASK = [[1, 1, 0], [1, 1, 1]]
PROXIMAL = [[-1.0, -2.0, -0.5], [-3.0, -0.7, -1.2]]


def hand_example() -> tuple[torch.Tensor, ...]:
    proximal = torch.tensor(PROXIMAL, dtype=torch.float64)
    logprobs = proximal + torch.tensor(RATIO, dtype=torch.float64).log()
    behaviour = proximal - torch.tensor(RHO, dtype=torch.float64).log()
    advantages = torch.tensor(ADVANTAGES, dtype=torch.float64)
    mask = torch.tensor(MASK, dtype=torch.bool)
    return logprobs, proximal, behaviour, advantages, mask


def test_decoupled_ppo_loss_value_and_stats() -> None:
    logprobs, proximal, behaviour, advantages, mask = hand_example()
    out = decoupled_ppo_loss(logprobs, proximal, behaviour, advantages, mask, 5, CLIP_EPS, IS_CAP)
    assert out.loss.item() == pytest.approx(-0.56, abs=1e-9)
    # tokens (0,1) and (1,0) took the clipped branch; the masked (0,2) would too but must not count
    assert out.stats["clip_fraction"] == pytest.approx(2 / 5)
    # w over loss tokens: 1, 1, 1, 2, 0.5 -> mean 5.5 / 5 = 1.1, max 2
    assert out.stats["is_weight_mean"] == pytest.approx(1.1)
    assert out.stats["is_weight_max"] == pytest.approx(2.0)
    # only (1,1) has rho = 3 > cap (masked (0,2) has rho = e^4 but is not a loss token)
    assert out.stats["is_truncated_fraction"] == pytest.approx(1 / 5)
    # rho - 1 - ln rho: 0, 0, 0, 3-1-ln3 = 0.9013877, 0.5-1-ln0.5 = 0.1931472 -> 1.0945349 / 5
    assert out.stats["mismatch_kl"] == pytest.approx(0.2189070, abs=1e-6)


def test_decoupled_ppo_loss_gradients() -> None:
    logprobs, proximal, behaviour, advantages, mask = hand_example()
    logprobs.requires_grad_(True)
    proximal.requires_grad_(True)
    behaviour.requires_grad_(True)
    decoupled_ppo_loss(logprobs, proximal, behaviour, advantages, mask, 5, CLIP_EPS, IS_CAP).loss.backward()
    # unclipped tokens: d l / d logp = -w * A * u / N
    #   (0,0): -1 * 1 * 1.1 / 5 = -0.22;  (1,1): -2 * 0.5 * 1 / 5 = -0.2;  (1,2): -0.5 * -2 * 0.9 / 5 = 0.18
    # clipped (0,1), (1,0) and masked (0,2): exactly 0
    expected = torch.tensor([[-0.22, 0.0, 0.0], [0.0, -0.2, 0.18]], dtype=torch.float64)
    torch.testing.assert_close(logprobs.grad, expected, atol=1e-12, rtol=0)
    assert logprobs.grad[0, 1] == 0 and logprobs.grad[1, 0] == 0 and logprobs.grad[0, 2] == 0
    for constant in (proximal, behaviour):  # pi_prox and mu are constants of the objective
        assert constant.grad is None or torch.all(constant.grad == 0)


def test_decoupled_ppo_loss_is_invariant_to_micro_batching() -> None:
    generator = torch.Generator().manual_seed(0)
    shape = (4, 7)
    logprobs = -torch.rand(shape, generator=generator, dtype=torch.float64) * 3
    proximal = logprobs + 0.3 * torch.randn(shape, generator=generator, dtype=torch.float64)
    behaviour = proximal + 0.5 * torch.randn(shape, generator=generator, dtype=torch.float64)
    advantages = torch.randn(shape, generator=generator, dtype=torch.float64)
    mask = torch.rand(shape, generator=generator) < 0.7
    mask[0, :] = True
    mask[3, 5:] = False  # micro-batches with different loss-token counts
    num_loss_tokens = int(mask.sum())

    full = logprobs.clone().requires_grad_(True)
    full_loss = decoupled_ppo_loss(
        full, proximal, behaviour, advantages, mask, num_loss_tokens, 0.2, 2.0
    ).loss
    full_loss.backward()

    split = logprobs.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for rows in (slice(0, 1), slice(1, 4)):
        part = decoupled_ppo_loss(
            split[rows],
            proximal[rows],
            behaviour[rows],
            advantages[rows],
            mask[rows],
            num_loss_tokens,
            0.2,
            2.0,
        ).loss
        part.backward()
        total = total + part.detach()

    assert int(mask[0:1].sum()) != int(mask[1:4].sum())  # a per-micro-batch mean would differ
    assert total.item() == pytest.approx(full_loss.item(), abs=1e-12)
    torch.testing.assert_close(split.grad, full.grad, atol=1e-12, rtol=0)
    assert full.grad.abs().sum() > 0


# ---------------------------------------------------------------- log-probs


def test_logprobs_from_logits_hand_example() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    ids = torch.tensor([2, 0])
    # T=1: logsumexp = 3 + ln(1 + e^-1 + e^-2) = 3 + ln 1.5032147 = 3.4076060
    #   log p(2) = 3 - 3.4076060 = -0.4076060, log p(0) = 1 - 3.4076060 = -2.4076060
    expected_t1 = torch.tensor([-0.4076060, -2.4076060])
    torch.testing.assert_close(logprobs_from_logits(logits, ids, 1.0), expected_t1, atol=1e-6, rtol=0)
    # T=2: logits / 2 = [0.5, 1, 1.5]; logsumexp = 1.5 + ln(1 + e^-0.5 + e^-1) = 1.5 + ln 1.9744101 = 2.1802697
    #   log p(2) = 1.5 - 2.1802697 = -0.6802697, log p(0) = 0.5 - 2.1802697 = -1.6802697
    expected_t2 = torch.tensor([-0.6802697, -1.6802697])
    torch.testing.assert_close(logprobs_from_logits(logits, ids, 2.0), expected_t2, atol=1e-6, rtol=0)
    # temperature 0 (greedy) is scored under the unscaled distribution
    torch.testing.assert_close(logprobs_from_logits(logits, ids, 0.0), expected_t1, atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = build_tiny(ModelConfig())
    return model.eval(), tokenizer


def test_sequence_logprobs_is_aligned_with_the_token_it_scores(tiny) -> None:
    model, tokenizer = tiny
    ids = torch.tensor([tokenizer.encode("12+34=46")])
    with torch.no_grad():
        logprobs, _ = sequence_logprobs(model, ids, torch.ones_like(ids), 1.0)
        logits = model(input_ids=ids).logits[0]
    assert logprobs.shape == ids.shape
    assert logprobs[0, 0].item() == 0.0
    for t in range(1, ids.shape[1]):  # position t holds log p(ids[t] | ids[:t]), from logits at t-1
        expected = torch.log_softmax(logits[t - 1].double(), -1)[ids[0, t]].item()
        assert logprobs[0, t].item() == pytest.approx(expected, abs=1e-5)


def test_sequence_logprobs_matches_engine_sampling_logprobs(tiny) -> None:
    model, tokenizer = tiny
    engine = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, "cpu")
    engine.load_weights(model.state_dict(), 0)
    # different lengths: the engine left-pads the short prompts, the trainer right-pads
    prompts = [tokenizer.encode(text) for text in ("57+68=", "5+6=", "123+4=", "9=")]
    for temperature in (1.0, 0.7):
        sampling = SamplingParams(temperature=temperature, max_new_tokens=6)
        completions = engine.generate(prompts, sampling, seed=0)
        rows = [prompt + c.token_ids for prompt, c in zip(prompts, completions, strict=True)]
        width = max(len(row) for row in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            attention[i, : len(row)] = 1
        with torch.no_grad():
            logprobs, _ = sequence_logprobs(model, ids, attention, temperature)
        for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            assert len(completion.logprobs) == len(completion.token_ids) > 0
            assert completion.policy_versions == [0] * len(completion.token_ids)
            trainer_side = logprobs[i, len(prompt) : len(prompt) + len(completion.token_ids)]
            torch.testing.assert_close(trainer_side, torch.tensor(completion.logprobs), atol=1e-5, rtol=0)
