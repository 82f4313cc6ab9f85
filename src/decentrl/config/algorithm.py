"""Typed configuration of the policy update: one model per variant, chosen by its `name` field.

Kept free of torch (the coordinator and the CLI load configs without it). Each variant's
implementation lives in its own file under `algo/advantages/`, `algo/losses/` and
`algo/corrections/`; `algo/registry.py` maps a config to its implementation. In TOML:

    [algorithm.loss]
    name = "dapo"
    eps_high = 0.28

Defaults and sources: docs/algorithm-reference.md (section numbers cited per field).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from decentrl.config.base import Section

# ------------------------------------------------------------------ advantage estimators


class GRPOAdvantage(Section):
    """GRPO (arXiv 2402.03300, §1.2): (R - group mean) / (group std + eps)."""

    name: Literal["grpo"] = "grpo"
    eps: float = Field(default=1e-6, gt=0)
    """Added to the std, so an all-equal group gets exact zeros, not NaN."""


class DrGRPOAdvantage(Section):
    """Dr. GRPO (arXiv 2503.20783, §1.3): R - group mean, no std division. Pair it with
    `aggregation = "constant"` to drop the length normalisation as the paper does."""

    name: Literal["dr_grpo"] = "dr_grpo"


class RLOOAdvantage(Section):
    """RLOO (arXiv 2402.14740, §1.5): R_i minus the mean of the other samples of its group."""

    name: Literal["rloo"] = "rloo"


class ReinforcePPAdvantage(Section):
    """REINFORCE++ (arXiv 2501.03262, §1.6): global batch normalisation of the returns."""

    name: Literal["reinforce_pp"] = "reinforce_pp"
    baseline: bool = False
    """REINFORCE++-baseline: subtract the group mean first, then normalise by the batch std."""
    eps: float = Field(default=1e-6, gt=0)


AdvantageConfig = Annotated[
    GRPOAdvantage | DrGRPOAdvantage | RLOOAdvantage | ReinforcePPAdvantage, Field(discriminator="name")
]

# ------------------------------------------------------------------ policy losses


class PPOClipLoss(Section):
    """PPO clipped surrogate per token (arXiv 1707.06347, §1.1), optional dual clip (§2.5)."""

    name: Literal["ppo_clip"] = "ppo_clip"
    eps_low: float = Field(default=0.2, gt=0, lt=1)
    eps_high: float = Field(default=0.2, gt=0)
    dual_clip: float | None = Field(default=None, gt=1)
    """Dual-clip constant c (Ye et al. 2020; verl clip_ratio_c=3.0): for A<0 the loss is capped
    at c·|A|, so a token whose ratio exploded cannot dominate. None disables it."""


class DAPOLoss(Section):
    """DAPO (arXiv 2503.14476, §1.4): clip-higher, token-level aggregation, dynamic sampling,
    overlong reward shaping."""

    name: Literal["dapo"] = "dapo"
    eps_low: float = Field(default=0.2, gt=0, lt=1)
    eps_high: float = Field(default=0.28, gt=0)
    dynamic_sampling: bool = True
    """Train only on groups whose rewards are not all equal; the coordinator waits for enough
    such groups to fill the batch (it over-samples by leasing on)."""
    overlong_buffer_tokens: int = Field(default=0, ge=0)
    """L_cache: a completion longer than max_new_tokens - L_cache gets a linear penalty down to
    -overlong_penalty at max_new_tokens (0 disables). The paper uses 4096 of 20480."""
    overlong_penalty: float = Field(default=1.0, ge=0)
    """Penalty at the full generation budget (the paper's factor 1.0)."""


class GSPOLoss(Section):
    """GSPO (arXiv 2507.18071, §1.7): one ratio per sequence, exp(mean_t log r_t)."""

    name: Literal["gspo"] = "gspo"
    eps_low: float = Field(default=3e-4, gt=0, lt=1)
    eps_high: float = Field(default=4e-4, gt=0)


class CISPOLoss(Section):
    """CISPO (MiniMax-M1, arXiv 2506.13585, §1.8): sg(clip(r)) · A · log pi on every token."""

    name: Literal["cispo"] = "cispo"
    eps_low: float = Field(default=1.0, gt=0)
    """M1 effectively disables the lower bound; 1.0 makes it 0 (a weight cannot go negative)."""
    eps_high: float = Field(default=0.28, gt=0)


LossConfig = Annotated[PPOClipLoss | DAPOLoss | GSPOLoss | CISPOLoss, Field(discriminator="name")]

# ------------------------------------------------------------------ off-policy corrections
# rho = pi_prox / mu per token: trainer (current weights) over the worker's sampling policy.


class NoCorrection(Section):
    """Naive PPO: the clip is centred on the behaviour policy mu and no weight is applied, as if
    stale samples came from the policy being updated (AReaL's 'naive PPO' baseline, §2.2)."""

    name: Literal["none"] = "none"


class DecoupledCorrection(Section):
    """Decoupled PPO (Hilton et al. arXiv 2110.00641; AReaL arXiv 2505.24298, §2.2): the clip is
    centred on pi_prox and each token is weighted by rho."""

    name: Literal["decoupled"] = "decoupled"
    cap: float = Field(default=5.0, gt=1)
    """Tokens with rho above `cap` are masked (AReaL rejection upper bound 5.0) or truncated."""
    action: Literal["mask", "truncate"] = "mask"
    """AReaL `rejection_sampling.action`: mask drops the token, truncate clamps its weight to cap."""


class TISCorrection(Section):
    """Truncated importance sampling (Yao et al., §2.3): weight min(rho, cap), token or sequence."""

    name: Literal["tis"] = "tis"
    cap: float = Field(default=2.0, gt=0)
    """C in min(rho, C); verl's DAPO example and default threshold use 2.0."""
    level: Literal["token", "sequence"] = "token"
    """sequence: rho is the product over the sequence's loss tokens (unbiased, higher variance)."""


class MISCorrection(Section):
    """Masked importance sampling (§2.4): weight rho, but reject tokens (or whole sequences) whose
    rho falls outside [lower, upper]."""

    name: Literal["mis"] = "mis"
    lower: float = Field(default=0.0, ge=0)
    upper: float = Field(default=2.0, gt=0)
    level: Literal["token", "sequence"] = "sequence"
    """verl's seq-MIS preset rejects sequences whose rho product exceeds 2.0."""


class IcePopCorrection(Section):
    """IcePop (Ring-1T, arXiv 2510.18855, §2.4): weight rho inside [alpha, beta], zero outside."""

    name: Literal["icepop"] = "icepop"
    alpha: float = Field(default=0.5, gt=0)
    beta: float = Field(default=5.0, gt=1)
    """verl's `decoupled_token_icepop` preset band is [0.5, 5.0]."""


class M2POCorrection(Section):
    """M2PO (arXiv 2510.01161, §2.6): mask the tokens of largest (log rho)^2 until the mean of
    the kept ones is below tau; weight rho on the rest, no clip."""

    name: Literal["m2po"] = "m2po"
    tau: float = Field(default=0.04, gt=0)
    """Threshold on the batch's second moment of the log ratio (AReaL example m2_threshold=0.04)."""
    tokens: Literal["all", "with_advantage"] = "all"
    """Which tokens the mask may drop, and whose M2 is averaged. all: every loss token (the
    paper's text, AReaL's `m2_threshold`). with_advantage: only tokens whose probability has
    already moved the way their advantage pushes (A · log rho > 0), as the authors' released code
    constrains only these; a token that drifted against its advantage always keeps the gradient
    that pulls it back."""


CorrectionConfig = Annotated[
    NoCorrection | DecoupledCorrection | TISCorrection | MISCorrection | IcePopCorrection | M2POCorrection,
    Field(discriminator="name"),
]

# ------------------------------------------------------------------ the whole update


class AlgorithmConfig(Section):
    """How a batch of scored groups becomes one version's optimizer steps."""

    advantage: AdvantageConfig = GRPOAdvantage()
    loss: LossConfig = PPOClipLoss()
    correction: CorrectionConfig = DecoupledCorrection()
    aggregation: Literal["token_mean", "sequence_mean", "constant"] = "token_mean"
    """Denominator of the summed per-token loss, always over the *global* batch so micro-batching
    cannot change it (§0, §4.5): token_mean = number of loss tokens (DAPO, prime-rl);
    sequence_mean = number of sequences, each first averaged over its own tokens (GRPO paper,
    GSPO); constant = number of sequences x max_new_tokens (Dr. GRPO)."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of a KL penalty to the frozen initial (reference) model; 0 = no reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token estimator (Schulman; §1.2): k1 = log(pi/ref), k2 = (log(pi/ref))^2/2,
    k3 = ref/pi - 1 - log(ref/pi). The loss weights it by pi_theta / mu with the ratio's gradient
    (DeepSeek-V3.2), so k1 and k3 give the exact reverse-KL gradient in expectation (k3 with less
    variance) and k2 a biased one."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Entropy bonus: the loss subtracts coef x mean entropy of the sampled positions."""
