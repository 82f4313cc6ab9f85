"""Off-policy corrections and the KL regulariser against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from decentrl.algo.corrections import mismatch_kl, rejection_stats
from decentrl.algo.corrections.decoupled import Decoupled
from decentrl.algo.corrections.icepop import IcePop
from decentrl.algo.corrections.m2po import M2PO
from decentrl.algo.corrections.mis import MIS
from decentrl.algo.corrections.no_correction import NoneCorrection
from decentrl.algo.corrections.tis import TIS
from decentrl.algo.kl import kl_per_token, sampled_kl_per_token
from decentrl.config.algorithm import (
    DecoupledCorrection,
    IcePopCorrection,
    M2POCorrection,
    MISCorrection,
    NoCorrection,
    TISCorrection,
)

# rho = pi_prox / mu on a 2x3 batch; token (1,2) is not a loss token (its rho must not matter)
RHO = [[1.0, 3.0, 0.4], [6.0, 0.5, 100.0]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]]).bool()
PROXIMAL = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.7, -1.2]], dtype=torch.float64)
BEHAVIOUR = PROXIMAL - torch.tensor(RHO, dtype=torch.float64).log()
# (0,1): A > 0 and rho 3 > 1, moved with its advantage; (1,0): A < 0 and rho 6 > 1, and (1,1):
# A > 0 and rho 0.5 < 1, moved against theirs; (0,0) did not move, (0,2) has A = 0
ADVANTAGES = torch.tensor([[1.0, 2.0, 0.0], [-0.5, 1.0, 9.0]], dtype=torch.float64)


def weights(correction) -> list[list[float]]:
    out = correction(PROXIMAL, BEHAVIOUR, MASK, ADVANTAGES)
    return torch.where(MASK, out.weights_bt, torch.full_like(out.weights_bt, -1.0)).tolist()


def close(actual: list[list[float]], expected: list[list[float]]) -> None:
    torch.testing.assert_close(
        torch.tensor(actual, dtype=torch.float64),
        torch.tensor(expected, dtype=torch.float64),
        atol=1e-9,
        rtol=0,
    )


def test_none_anchors_on_mu_with_unit_weights() -> None:
    out = NoneCorrection(NoCorrection())(PROXIMAL, BEHAVIOUR, MASK, ADVANTAGES)
    assert torch.equal(out.anchor_logprobs_bt, BEHAVIOUR)
    close(weights(NoneCorrection(NoCorrection())), [[1, 1, 1], [1, 1, -1]])


def test_decoupled_masks_or_truncates_above_cap() -> None:
    out = Decoupled(DecoupledCorrection())(PROXIMAL, BEHAVIOUR, MASK, ADVANTAGES)
    assert torch.equal(out.anchor_logprobs_bt, PROXIMAL)
    # cap 5, mask: rho 6 -> 0
    close(weights(Decoupled(DecoupledCorrection())), [[1, 3, 0.4], [0, 0.5, -1]])
    close(weights(Decoupled(DecoupledCorrection(cap=2.0, action="truncate"))), [[1, 2, 0.4], [2, 0.5, -1]])
    # weights 1, 3, 0.4, 0, 0.5: sum 4.9, sum of squares 10.41 -> ESS = 4.9^2 / (5 * 10.41) = 0.4612872
    assert out.stats["is_ess_fraction"] == pytest.approx(4.9**2 / (5 * 10.41))
    assert out.stats["is_rejected_fraction"] == pytest.approx(1 / 5)
    assert out.stats["is_weight_max"] == pytest.approx(3.0)


def test_tis_token_and_sequence() -> None:
    close(weights(TIS(TISCorrection())), [[1, 2, 0.4], [2, 0.5, -1]])
    # sequence: row 0 product 1 * 3 * 0.4 = 1.2; row 1 (loss tokens only) 6 * 0.5 = 3 -> min(3, 2) = 2
    close(weights(TIS(TISCorrection(level="sequence"))), [[1.2, 1.2, 1.2], [2, 2, -1]])


def test_mis_rejects_outside_the_band() -> None:
    # sequence [0, 2]: row 0 product 1.2 kept on every token; row 1 product 3 rejected whole
    close(weights(MIS(MISCorrection())), [[1.2, 1.2, 1.2], [0, 0, -1]])
    close(weights(MIS(MISCorrection(level="token", lower=0.5, upper=2.0))), [[1, 0, 0], [0, 0.5, -1]])


def test_icepop_band() -> None:
    # [0.5, 5]: 3 kept, 0.4 and 6 zeroed, 0.5 kept (bounds inclusive)
    close(weights(IcePop(IcePopCorrection())), [[1, 3, 0], [0, 0.5, -1]])


def test_m2po_greedily_masks_the_largest_second_moments() -> None:
    # M2 = (ln rho)^2: 0, 1.2069, 0.8396, 3.2104, 0.4805 (mean 1.1475)
    # tau 0.5: drop 3.2104 -> mean 0.6318, still >= 0.5; drop 1.2069 -> mean 0.4400 < 0.5: stop
    close(weights(M2PO(M2POCorrection(tau=0.5))), [[1, 0, 0.4], [0, 0.5, -1]])
    # tau above the overall mean: nothing masked, every token keeps rho
    close(weights(M2PO(M2POCorrection(tau=2.0))), [[1, 3, 0.4], [6, 0.5, -1]])


def test_mismatch_kl_is_k3_of_rho_on_loss_tokens() -> None:
    # rho - 1 - ln rho: 0, 3-1-ln3 = 0.9013877, 0.4-1-ln0.4 = 0.3162907, 6-1-ln6 = 3.2082405,
    # 0.5-1-ln0.5 = 0.1931472 -> sum 4.6190661 / 5
    assert mismatch_kl(PROXIMAL, BEHAVIOUR, MASK) == pytest.approx(4.6190661 / 5, abs=1e-6)


def test_kl_estimators_values_and_gradients() -> None:
    # log pi = -1, log ref = -1.5: log u = -0.5
    #   k1 = 0.5; k2 = 0.125; k3 = e^-0.5 - 1 + 0.5 = 0.1065307
    #   d/dlog pi: k1 -> 1; k2 -> -log u = 0.5; k3 -> 1 - e^-0.5 = 0.3934693
    expected = {"k1": (0.5, 1.0), "k2": (0.125, 0.5), "k3": (math.exp(-0.5) - 0.5, 1 - math.exp(-0.5))}
    for name, (value, gradient) in expected.items():
        logprobs = torch.tensor([-1.0], dtype=torch.float64, requires_grad=True)
        reference = torch.tensor([-1.5], dtype=torch.float64, requires_grad=True)
        kl = kl_per_token(logprobs, reference, name)
        kl.sum().backward()
        assert kl.item() == pytest.approx(value, abs=1e-7), name
        assert logprobs.grad.item() == pytest.approx(gradient, abs=1e-7), name
        assert reference.grad is None  # the reference is frozen
    # k3 is never negative; k1 is when the policy is below the reference
    assert kl_per_token(torch.tensor([-2.0]), torch.tensor([-1.0]), "k1").item() < 0
    assert kl_per_token(torch.tensor([-2.0]), torch.tensor([-1.0]), "k3").item() > 0


def test_sampled_kl_weights_k3_by_pi_theta_over_mu_with_its_gradient() -> None:
    # log pi = -1, anchor -1.2, weight 0.5, log ref = -1.5: r = e^0.2 = 1.2214028, k3 = 0.1065307
    #   KL_t = 0.5 * 1.2214028 * 0.1065307 = 0.0650584
    #   d/dlog pi = 0.5 r (k3 + 1 - e^-0.5) = 0.5 r (log pi - log ref) = 0.5 * 1.2214028 * 0.5 = 0.3053507
    logprobs = torch.tensor([-1.0], dtype=torch.float64, requires_grad=True)
    anchor, weight, reference = (torch.tensor([v], dtype=torch.float64) for v in (-1.2, 0.5, -1.5))
    kl = sampled_kl_per_token(logprobs, anchor, weight, reference, "k3")
    kl.sum().backward()
    assert kl.item() == pytest.approx(0.0650584, abs=1e-7)
    assert logprobs.grad.item() == pytest.approx(0.3053507, abs=1e-7)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_sampled_kl_has_the_reverse_kl_gradient_under_stale_samples(estimator: str) -> None:
    # Four tokens sampled by a stale mu, decoupled weights pi_prox / mu: the expected KL term,
    # sum_x mu(x) KL_t(x), is KL(pi_theta || pi_ref) and has its gradient exactly
    def policy(*logits: float) -> torch.Tensor:
        return torch.log_softmax(torch.tensor(logits, dtype=torch.float64), -1)

    logits = torch.tensor([0.3, -0.2, 1.1, -0.7], dtype=torch.float64, requires_grad=True)
    logprobs = torch.log_softmax(logits, -1)
    proximal, behaviour, reference = (
        policy(0.1, 0.0, 0.9, -0.5),
        policy(0.5, -0.4, 0.7, -0.2),
        policy(-0.3, 0.2, 0.4, 0.1),
    )
    weights = (proximal - behaviour).exp()
    term = (behaviour.exp() * sampled_kl_per_token(logprobs, proximal, weights, reference, estimator)).sum()
    exact = (logprobs.exp() * (logprobs - reference)).sum()
    torch.testing.assert_close(term, exact, rtol=0, atol=1e-12)
    (term_grad,) = torch.autograd.grad(term, logits, retain_graph=True)
    (exact_grad,) = torch.autograd.grad(exact, logits)
    torch.testing.assert_close(term_grad, exact_grad, rtol=0, atol=1e-12)


def test_m2po_with_advantage_masks_only_tokens_that_moved_with_their_advantage() -> None:
    with_advantage = M2POCorrection(tau=0.5, tokens="with_advantage")
    # Only (0,1) (M2 1.2069) may be masked; its mean 1.2069 >= 0.5, so it is. The bad token that
    # became 6 times more likely keeps its weight (tokens = "all" masks it: see above).
    close(weights(M2PO(with_advantage)), [[1, 0, 0.4], [6, 0.5, -1]])
    # All advantages positive: (0,1) and (1,0) moved with theirs, M2 1.2069 and 3.2104, mean
    # 2.2087 >= 1.5; dropping 3.2104 leaves 1.2069 < 1.5. Over every loss token the mean is
    # 1.1475 < 1.5, so tokens = "all" masks nothing.
    positive = torch.ones_like(ADVANTAGES)
    out = M2PO(M2POCorrection(tau=1.5, tokens="with_advantage"))(PROXIMAL, BEHAVIOUR, MASK, positive)
    close(torch.where(MASK, out.weights_bt, -1.0).tolist(), [[1, 3, 0.4], [0, 0.5, -1]])
    close(weights(M2PO(M2POCorrection(tau=1.5))), [[1, 3, 0.4], [6, 0.5, -1]])


def test_m2po_reports_its_second_moments() -> None:
    # the same M2s: all five loss tokens mean 1.1475; kept at tau 0.5 (0, 0.8396, 0.4805) 0.4400
    stats = M2PO(M2POCorrection(tau=0.5))(PROXIMAL, BEHAVIOUR, MASK, ADVANTAGES).stats
    m2 = [math.log(r) ** 2 for r in (1.0, 3.0, 0.4, 6.0, 0.5)]
    assert stats["m2"] == pytest.approx(sum(m2) / 5)
    assert stats["m2_kept"] == pytest.approx((m2[0] + m2[2] + m2[4]) / 3)
    assert stats["is_rejected_fraction"] == pytest.approx(2 / 5)


def test_rejection_stats_split_the_rejected_signal_by_direction() -> None:
    # M2PO at tau 0.5 rejects rho 3 (token (0,1)) and rho 6 (token (1,0)).
    out = M2PO(M2POCorrection(tau=0.5))(PROXIMAL, BEHAVIOUR, MASK, ADVANTAGES)
    log_rho = (PROXIMAL - BEHAVIOUR).where(MASK, torch.zeros_like(PROXIMAL))
    # |A| on the loss tokens: 1 + 2 + 0 + 0.5 + 1 = 4.5, of which rejected 2 + 0.5 = 2.5.
    # (0,1) moved with its advantage, (1,0) against it (a bad token became more likely): 1 of
    # the 2 rejected informative tokens
    stats = rejection_stats(out.weights_bt, log_rho, ADVANTAGES, MASK)
    assert stats["is_rejected_advantage_share"] == pytest.approx(2.5 / 4.5)
    assert stats["is_rejected_corrective_fraction"] == pytest.approx(1 / 2)
