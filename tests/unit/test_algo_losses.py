"""Policy losses, alone and after an off-policy correction, against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from decentrl.algo.aggregation import BatchCounts, token_scale
from decentrl.algo.corrections.decoupled import Decoupled
from decentrl.algo.losses import LossInputs
from decentrl.algo.losses.cispo import CISPO
from decentrl.algo.losses.dapo import DAPO, overlong_penalty
from decentrl.algo.losses.gspo import GSPO
from decentrl.algo.losses.ppo_clip import PPOClip
from decentrl.config.algorithm import (
    CISPOLoss,
    DAPOLoss,
    DecoupledCorrection,
    GSPOLoss,
    PPOClipLoss,
)

# Six tokens in a 2x3 batch. Per token: u = pi/pi_prox, rho = pi_prox/mu, advantage A, loss mask.
# Decoupled PPO with truncated weights w = min(rho, 2), clip 0.2:
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


def tensors(ratio=RATIO, rho=RHO, advantages=ADVANTAGES, mask=MASK, proximal=PROXIMAL):
    proximal = torch.tensor(proximal, dtype=torch.float64)
    logprobs = (proximal + torch.tensor(ratio, dtype=torch.float64).log()).requires_grad_(True)
    behaviour = proximal - torch.tensor(rho, dtype=torch.float64).log()
    return (
        logprobs,
        proximal,
        behaviour,
        torch.tensor(advantages, dtype=torch.float64),
        torch.tensor(mask).bool(),
    )


def inputs_for(logprobs, anchor, weights, advantages, mask, aggregation="token_mean", max_new_tokens=3):
    counts = BatchCounts(int(mask.sum()), mask.shape[0], max_new_tokens)
    scale = token_scale(aggregation, mask, counts, torch.float64)
    return LossInputs(logprobs, anchor, weights, advantages, mask, scale)


def test_decoupled_ppo_hand_example_value_gradients_and_stats() -> None:
    logprobs, proximal, behaviour, advantages, mask = tensors()
    correction = Decoupled(DecoupledCorrection(cap=2.0, action="truncate"))(
        proximal, behaviour, mask, advantages
    )
    out = PPOClip(PPOClipLoss())(
        inputs_for(logprobs, correction.anchor_logprobs_bt, correction.weights_bt, advantages, mask)
    )
    assert out.loss.item() == pytest.approx(-0.56, abs=1e-9)
    assert out.stats["clip_fraction"] == pytest.approx(2 / 5)  # (0,1), (1,0); masked (0,2) not counted
    # w over loss tokens: 1, 1, 1, 2, 0.5 -> mean 1.1, max 2
    assert correction.stats["is_weight_mean"] == pytest.approx(1.1)
    assert correction.stats["is_weight_max"] == pytest.approx(2.0)
    out.loss.backward()
    # unclipped tokens: d l / d logp = -w * A * u / N
    #   (0,0): -1 * 1 * 1.1 / 5 = -0.22;  (1,1): -2 * 0.5 * 1 / 5 = -0.2;  (1,2): -0.5 * -2 * 0.9 / 5 = 0.18
    # clipped (0,1), (1,0) and masked (0,2): exactly 0
    expected = torch.tensor([[-0.22, 0.0, 0.0], [0.0, -0.2, 0.18]], dtype=torch.float64)
    torch.testing.assert_close(logprobs.grad, expected, atol=1e-12, rtol=0)


def test_decoupled_weights_are_constants_of_the_objective() -> None:
    logprobs, proximal, behaviour, advantages, mask = tensors()
    proximal.requires_grad_(True)
    behaviour.requires_grad_(True)
    correction = Decoupled(DecoupledCorrection(cap=2.0, action="truncate"))(
        proximal, behaviour, mask, advantages
    )
    out = PPOClip(PPOClipLoss())(
        inputs_for(logprobs, correction.anchor_logprobs_bt, correction.weights_bt, advantages, mask)
    )
    out.loss.backward()
    assert proximal.grad is None and behaviour.grad is None  # pi_prox and mu get no gradient
    assert logprobs.grad.abs().sum() > 0


def one_token(ratio: float, advantage: float):
    logprobs = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    anchor = torch.zeros(1, 1, dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    return logprobs, inputs_for(
        logprobs,
        anchor,
        torch.ones(1, 1, dtype=torch.float64),
        torch.tensor([[advantage]], dtype=torch.float64),
        mask,
    )


def test_dual_clip_caps_negative_advantage_tokens() -> None:
    # r = 5, A = -1: min(5 * -1, 1.2 * -1) = -5 -> loss 5, gradient -A r = 5
    logprobs, inputs = one_token(5.0, -1.0)
    out = PPOClip(PPOClipLoss())(inputs)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(5.0) and logprobs.grad.item() == pytest.approx(5.0)
    # dual clip c = 3: the loss is capped at c|A| = 3, a constant: no gradient, counted as clipped
    logprobs, inputs = one_token(5.0, -1.0)
    out = PPOClip(PPOClipLoss(dual_clip=3.0))(inputs)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(3.0) and logprobs.grad.item() == 0.0
    assert out.stats["clip_fraction"] == 1.0
    # a positive advantage is not affected by the dual clip: r = 1.1, A = 2 -> -2.2
    _, inputs = one_token(1.1, 2.0)
    assert PPOClip(PPOClipLoss(dual_clip=3.0))(inputs).loss.item() == pytest.approx(-2.2)


def test_dapo_clips_higher_above_than_below() -> None:
    # r = 1.25, A = 1: inside 1 + 0.28 -> -1.25, gradient -1.25 (symmetric PPO 0.2 would clip: -1.2, 0)
    logprobs, inputs = one_token(1.25, 1.0)
    out = DAPO(DAPOLoss())(inputs)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-1.25) and logprobs.grad.item() == pytest.approx(-1.25)
    _, inputs = one_token(1.25, 1.0)
    assert PPOClip(PPOClipLoss())(inputs).loss.item() == pytest.approx(-1.2)
    # r = 0.75, A = -1: below 1 - 0.2 -> min(-0.75, -0.8) = -0.8 -> loss 0.8, clipped
    logprobs, inputs = one_token(0.75, -1.0)
    out = DAPO(DAPOLoss())(inputs)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(0.8) and logprobs.grad.item() == 0.0


def test_dapo_overlong_penalty_and_dynamic_sampling_flag() -> None:
    # L_max 10, L_cache 4: free up to 6, then linear to -1 at 10, -1 beyond
    lengths = torch.tensor([3, 6, 7, 8, 10, 12])
    expected = torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4, 1.0), expected)
    dapo = DAPO(DAPOLoss(overlong_buffer_tokens=4, overlong_penalty=0.5))
    shaped = dapo.shape_rewards(torch.tensor([1.0, 1.0]), torch.tensor([5, 9]), 10)
    torch.testing.assert_close(shaped, torch.tensor([1.0, 1.0 - 0.5 * 0.75]))
    assert dapo.filters_groups and not DAPO(DAPOLoss(dynamic_sampling=False)).filters_groups
    assert not PPOClip(PPOClipLoss()).filters_groups
    assert torch.equal(
        DAPO(DAPOLoss()).shape_rewards(torch.tensor([1.0]), torch.tensor([10]), 10), torch.tensor([1.0])
    )


def test_gspo_uses_one_length_normalised_ratio_per_sequence() -> None:
    # seq 0: log r = [0.1, 0.3] -> mean 0.2, s = e^0.2 = 1.2214 > 1.0004, A = 1 -> clipped: -1.0004
    # seq 1: log r = [0, 0.0002, (masked 5.0)] -> mean 0.0001, s = e^0.0001 inside, A = -2 -> 2 s
    # sequence_mean: loss = (-1.0004 + 2 e^0.0001) / 2
    log_ratio = [[0.1, 0.3, 0.0], [0.0, 0.0002, 5.0]]
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]]).bool()
    logprobs = torch.tensor(log_ratio, dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([[1.0] * 3, [-2.0] * 3], dtype=torch.float64)
    inputs = inputs_for(
        logprobs,
        torch.zeros(2, 3, dtype=torch.float64),
        torch.ones(2, 3, dtype=torch.float64),
        advantages,
        mask,
        "sequence_mean",
    )
    out = GSPO(GSPOLoss())(inputs)
    assert out.loss.item() == pytest.approx((-1.0004 + 2 * math.exp(0.0001)) / 2, abs=1e-12)
    assert out.stats["clip_fraction"] == 0.5
    out.loss.backward()
    # seq 0 clipped: no gradient. seq 1: d/dlogp_t [ -A s ] * (sum of its scales = 1/2), ds/dlogp_t = s/2
    #   = 2 * s / 2 * 1/2 = s / 2 on each of its two loss tokens; the masked token gets nothing
    s = math.exp(0.0001)
    expected = torch.tensor([[0.0, 0.0, 0.0], [s / 2, s / 2, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logprobs.grad, expected, atol=1e-12, rtol=0)


def test_gspo_leaves_a_rejected_token_out_of_its_sequence_ratio() -> None:
    # log r = [0.1, 3.0 (weight 0: rejected by the correction), 0.0002], A = -1, clip 0.1:
    # s = exp((0.1 + 0.0002) / 2) = e^0.0501 inside the clip; each kept token: -A s = s
    # sequence_mean: loss = (s * 1 + 0 + s * 1) / 3 = 2 s / 3 (the rejected token stays counted)
    logprobs = torch.tensor([[0.1, 3.0, 0.0002]], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    weights = torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float64)
    advantages = torch.full((1, 3), -1.0, dtype=torch.float64)
    zeros = torch.zeros(1, 3, dtype=torch.float64)
    out = GSPO(GSPOLoss(eps_low=0.1, eps_high=0.1))(
        inputs_for(logprobs, zeros, weights, advantages, mask, "sequence_mean")
    )
    s = math.exp(0.0501)
    assert out.loss.item() == pytest.approx(2 * s / 3, abs=1e-12)
    out.loss.backward()
    # d/dlogp_t (2 s / 3) = 2/3 * s / 2 on each kept token; the rejected one gets none
    expected = torch.tensor([[s / 3, 0.0, s / 3]], dtype=torch.float64)
    torch.testing.assert_close(logprobs.grad, expected, atol=1e-12, rtol=0)


def test_cispo_keeps_a_gradient_on_clipped_tokens_through_a_detached_weight() -> None:
    # token a: r = 1.5, A = 1 -> weight clip(1.5, 0, 1.28) = 1.28, loss -1.28 logp_a, grad -1.28 / 2
    # token b: r = 0.5, A = -1 -> weight 0.5 (eps_low = 1: no lower bound), grad +0.5 / 2
    logprobs = torch.tensor([[math.log(1.5), math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    advantages = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    ones = torch.ones(1, 2, dtype=torch.float64)
    out = CISPO(CISPOLoss())(
        inputs_for(logprobs, torch.zeros(1, 2, dtype=torch.float64), ones, advantages, mask)
    )
    expected_loss = (-1.28 * math.log(1.5) + 0.5 * math.log(0.5)) / 2
    assert out.loss.item() == pytest.approx(expected_loss, abs=1e-12)
    assert out.stats["clip_fraction"] == 0.5
    out.loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.64, 0.25]], dtype=torch.float64))
    # PPO on the same tokens: token a is clipped, so its gradient is exactly zero
    logprobs.grad = None
    PPOClip(PPOClipLoss())(
        inputs_for(logprobs, torch.zeros(1, 2, dtype=torch.float64), ones, advantages, mask)
    ).loss.backward()
    assert logprobs.grad[0, 0] == 0.0


LOSSES = [
    PPOClip(PPOClipLoss(dual_clip=3.0)),
    DAPO(DAPOLoss()),
    GSPO(GSPOLoss(eps_low=0.1, eps_high=0.1)),
    CISPO(CISPOLoss()),
]


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
@pytest.mark.parametrize("loss", LOSSES, ids=lambda loss: type(loss).__name__)
def test_micro_batching_changes_neither_loss_nor_gradients(loss, aggregation: str) -> None:
    generator = torch.Generator().manual_seed(0)
    shape = (4, 7)
    proximal = -torch.rand(shape, generator=generator, dtype=torch.float64) * 3
    logprobs = proximal + 0.3 * torch.randn(shape, generator=generator, dtype=torch.float64)
    behaviour = proximal + 0.5 * torch.randn(shape, generator=generator, dtype=torch.float64)
    advantages = torch.randn(shape[0], 1, generator=generator, dtype=torch.float64).expand(shape)
    mask = torch.rand(shape, generator=generator) < 0.7
    mask[0, :] = True
    mask[3, 5:] = False  # micro-batches with different loss-token counts
    counts = BatchCounts(int(mask.sum()), shape[0], 7)
    correction = Decoupled(DecoupledCorrection(cap=2.0, action="truncate"))(
        proximal, behaviour, mask, advantages
    )

    def run(rows: slice, logp: torch.Tensor) -> torch.Tensor:
        scale = token_scale(aggregation, mask[rows], counts, torch.float64)
        inputs = LossInputs(
            logp[rows],
            correction.anchor_logprobs_bt[rows],
            correction.weights_bt[rows],
            advantages[rows],
            mask[rows],
            scale,
        )
        return loss(inputs).loss

    full = logprobs.clone().requires_grad_(True)
    full_loss = run(slice(0, 4), full)
    full_loss.backward()
    split = logprobs.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 1), slice(1, 4)):
        part = run(rows, split)
        part.backward()
        total += part.item()
    assert int(mask[0:1].sum()) != int(mask[1:4].sum())  # a per-micro-batch mean would differ
    assert total == pytest.approx(full_loss.item(), abs=1e-12)
    torch.testing.assert_close(split.grad, full.grad, atol=1e-12, rtol=0)
    assert full.grad.abs().sum() > 0


def test_aggregations_hand_values() -> None:
    # rows with 2 and 1 loss tokens, budget 4
    mask = torch.tensor([[1, 1, 0], [0, 1, 0]]).bool()
    counts = BatchCounts(num_loss_tokens=3, num_sequences=2, max_new_tokens=4)
    torch.testing.assert_close(token_scale("token_mean", mask, counts), mask / 3.0)
    torch.testing.assert_close(
        token_scale("sequence_mean", mask, counts), torch.tensor([[0.25, 0.25, 0], [0, 0.5, 0]])
    )
    torch.testing.assert_close(token_scale("constant", mask, counts), mask / 8.0)
