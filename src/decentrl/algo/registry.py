"""Config -> implementation, for every algorithm variant (one dict per kind, no if-chains)."""

from __future__ import annotations

from decentrl.algo.advantages import AdvantageEstimator
from decentrl.algo.advantages.dr_grpo import DrGRPO
from decentrl.algo.advantages.grpo import GRPO
from decentrl.algo.advantages.reinforce_pp import ReinforcePP
from decentrl.algo.advantages.rloo import RLOO
from decentrl.algo.corrections import OffPolicyCorrection
from decentrl.algo.corrections.decoupled import Decoupled
from decentrl.algo.corrections.icepop import IcePop
from decentrl.algo.corrections.m2po import M2PO
from decentrl.algo.corrections.mis import MIS
from decentrl.algo.corrections.no_correction import NoneCorrection
from decentrl.algo.corrections.tis import TIS
from decentrl.algo.losses import PolicyLoss
from decentrl.algo.losses.cispo import CISPO
from decentrl.algo.losses.dapo import DAPO
from decentrl.algo.losses.gspo import GSPO
from decentrl.algo.losses.ppo_clip import PPOClip
from decentrl.config import algorithm as c

ADVANTAGES = {
    c.GRPOAdvantage: GRPO,
    c.DrGRPOAdvantage: DrGRPO,
    c.RLOOAdvantage: RLOO,
    c.ReinforcePPAdvantage: ReinforcePP,
}
LOSSES = {c.PPOClipLoss: PPOClip, c.DAPOLoss: DAPO, c.GSPOLoss: GSPO, c.CISPOLoss: CISPO}
CORRECTIONS = {
    c.NoCorrection: NoneCorrection,
    c.DecoupledCorrection: Decoupled,
    c.TISCorrection: TIS,
    c.MISCorrection: MIS,
    c.IcePopCorrection: IcePop,
    c.M2POCorrection: M2PO,
}


def build_advantage(config: c.AdvantageConfig) -> AdvantageEstimator:
    return ADVANTAGES[type(config)](config)


def build_loss(config: c.LossConfig) -> PolicyLoss:
    return LOSSES[type(config)](config)


def build_correction(config: c.CorrectionConfig) -> OffPolicyCorrection:
    return CORRECTIONS[type(config)](config)
