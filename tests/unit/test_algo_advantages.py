"""Advantage estimators against numbers worked out by hand in the comments."""

from __future__ import annotations

import pytest
import torch

from decentrl.algo.advantages.dr_grpo import DrGRPO
from decentrl.algo.advantages.grpo import GRPO
from decentrl.algo.advantages.reinforce_pp import ReinforcePP
from decentrl.algo.advantages.rloo import RLOO
from decentrl.config.algorithm import DrGRPOAdvantage, GRPOAdvantage, ReinforcePPAdvantage, RLOOAdvantage

grpo = GRPO(GRPOAdvantage())


def close(actual: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected), atol=1e-5, rtol=0)


def test_grpo_two_right_two_wrong() -> None:
    # mean 0.5; unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.5773503; A = ±0.5 / 0.5773503 = ±0.8660254
    (advantages,) = grpo([torch.tensor([1.0, 0.0, 0.0, 1.0])])
    close(advantages, [0.8660254, -0.8660254, -0.8660254, 0.8660254])


def test_grpo_two_samples_and_groups_are_independent() -> None:
    # rewards [3, 1]: mean 2, unbiased std sqrt(2) -> ±1/1.4142136 = ±0.7071068; [5, 5] -> zeros
    first, second = grpo([torch.tensor([3.0, 1.0]), torch.tensor([5.0, 5.0])])
    close(first, [0.7071068, -0.7071068])
    assert torch.equal(second, torch.zeros(2))


ESTIMATORS = [
    grpo,
    DrGRPO(DrGRPOAdvantage()),
    RLOO(RLOOAdvantage()),
    ReinforcePP(ReinforcePPAdvantage()),
    ReinforcePP(ReinforcePPAdvantage(baseline=True)),
]


@pytest.mark.parametrize("reward", [1.2, 0.8, 0.7, 0.1])
@pytest.mark.parametrize("estimator", ESTIMATORS, ids=lambda e: type(e).__name__)
def test_saturated_groups_get_exact_zeros_from_every_estimator(estimator, reward: float) -> None:
    # eight float32 copies of 1.2 (correct plus a 0.2 format term) have a mean one ulp off and a
    # std of about one ulp: (R - mean) / (std + eps) would be +0.106 on every sample, not 0
    group = torch.full((8,), reward)
    for advantages in estimator([group, group.clone()]):
        assert advantages.dtype == torch.float32
        assert torch.equal(advantages, torch.zeros(8)), advantages


def test_grpo_near_saturated_group_keeps_its_signal() -> None:
    # [1.2] * 7 + [0.2]: mean 1.075, deviations 0.125 and -0.875; unbiased var
    # = (7 * 0.015625 + 0.765625) / 7 = 0.125, std 0.3535534 -> 0.3535534 and -2.4748737
    (advantages,) = grpo([torch.tensor([1.2] * 7 + [0.2])])
    close(advantages, [0.3535534] * 7 + [-2.4748737])


def test_rloo_near_saturated_group() -> None:
    # [0.8, 0.8, 0.8, 0.0]: baselines (0.8 + 0.8 + 0) / 3 = 0.5333333 for the first three,
    # 0.8 for the last -> [0.2666667] * 3 + [-0.8]
    (advantages,) = RLOO(RLOOAdvantage())([torch.tensor([0.8, 0.8, 0.8, 0.0])])
    close(advantages, [0.2666667] * 3 + [-0.8])


def test_dr_grpo_is_mean_centred_without_std() -> None:
    # [1, 0, 0, 0]: mean 0.25 -> [0.75, -0.25, -0.25, -0.25] (GRPO would divide by std 0.5)
    (advantages,) = DrGRPO(DrGRPOAdvantage())([torch.tensor([1.0, 0.0, 0.0, 0.0])])
    close(advantages, [0.75, -0.25, -0.25, -0.25])


def test_rloo_leaves_each_sample_out_of_its_own_baseline() -> None:
    # [1, 0, 0, 1]: sample 0's baseline = (0 + 0 + 1) / 3 = 1/3 -> 2/3; sample 1's = 2/3 -> -2/3
    # equals k/(k-1) (R - mean) = 4/3 * ±0.5 = ±0.6666667
    (advantages,) = RLOO(RLOOAdvantage())([torch.tensor([1.0, 0.0, 0.0, 1.0])])
    close(advantages, [0.6666667, -0.6666667, -0.6666667, 0.6666667])
    # [3, 1, 2]: baselines 1.5, 2.5, 2.0 -> [1.5, -1.5, 0]
    (advantages,) = RLOO(RLOOAdvantage())([torch.tensor([3.0, 1.0, 2.0])])
    close(advantages, [1.5, -1.5, 0.0])


def test_reinforce_pp_normalises_over_the_whole_batch() -> None:
    # groups [1, 1] and [0, 0]: per-group estimators see no signal, the global one does:
    # batch [1, 1, 0, 0]: mean 0.5, unbiased std 0.5773503 -> ±0.8660254
    estimator = ReinforcePP(ReinforcePPAdvantage())
    first, second = estimator([torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0])])
    close(first, [0.8660254, 0.8660254])
    close(second, [-0.8660254, -0.8660254])


def test_reinforce_pp_baseline_subtracts_group_means_first() -> None:
    # groups [1, 0] and [4, 0]: centred [0.5, -0.5] and [2, -2]; batch mean 0,
    # unbiased var = (0.25 + 0.25 + 4 + 4) / 3 = 2.8333333, std 1.6832508
    # -> [0.2970443, -0.2970443], [1.1881771, -1.1881771]
    estimator = ReinforcePP(ReinforcePPAdvantage(baseline=True))
    first, second = estimator([torch.tensor([1.0, 0.0]), torch.tensor([4.0, 0.0])])
    close(first, [0.2970443, -0.2970443])
    close(second, [1.1881771, -1.1881771])
