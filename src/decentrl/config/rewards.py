"""Typed configuration of a run's reward: the rubric, the scoring pool and the monitors (`[reward]`).

Imports neither torch nor any scorer. In TOML:

    [reward]
    zero_flagged = true

    [[reward.terms]]
    function = "math_verify"

    [[reward.terms]]
    function = "format"
    gate = 1.0            # no reward at all unless the answer has exactly one \\boxed{}

    [[reward.terms]]
    function = "overlong"
    weight = 0.2
    args = {max_chars = 400}

With no terms the reward is the environment's own (`function = "env"`, weight 1).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import Field

from decentrl.config.base import Section


class RewardName(StrEnum):
    """Built-in reward functions (`rewards/functions.py`)."""

    ENV = "env"
    """The environment's own trusted reward (exact match, tool replay, hidden tests, math-verify)."""
    EXACT_MATCH = "exact_match"
    """1 when the stripped answer equals the gold answer."""
    MATH_VERIFY = "math_verify"
    """Symbolic equivalence of the answer's single `\\boxed{}` with the gold answer (math-verify)."""
    FORMAT = "format"
    """1 when the answer carries exactly one `\\boxed{}` (use as a gate)."""
    OVERLONG = "overlong"
    """Soft over-length penalty (DAPO): 0 up to `max_chars - buffer_chars`, down to -1 at `max_chars`."""
    JUDGE = "judge"
    """An LLM judge behind an OpenAI-compatible endpoint (`rewards/judge.py`)."""
    REWARD_MODEL = "reward_model"
    """A `*ForSequenceClassification` reward model served by the trusted `decentrl scorer` role."""
    CUSTOM = "custom"
    """Your own function: `args = {target = "my_package.rewards:my_reward", ...}`; the target is a
    class (built with the other args) or a function returning a reward function (docs/rewards.md)."""


REMOTE_FUNCTIONS = frozenset({RewardName.REWARD_MODEL})
"""Terms scored by a trusted helper role, not inside the coordinator's pool."""


class RewardTerm(Section):
    function: RewardName = RewardName.ENV
    """Which reward function (see `RewardName`)."""
    name: str | None = None
    """Label of the term on /metrics and in diagnostics; default: the function's name."""
    weight: float = 1.0
    """Weight in the sum; 0 makes the term a logged metric that does not change the reward."""
    gate: float | None = None
    """When set, the term is a gate: the whole reward is 0 unless it scores at least this much
    (its weight is then ignored)."""
    args: dict[str, Any] = {}
    """Keyword arguments of the function (e.g. `{max_chars = 400}` for overlong)."""

    @property
    def label(self) -> str:
        return self.name or self.function.value


class RewardMonitorConfig(Section):
    """Reward-hacking monitors (docs/rewards.md): each alarm is an event, a counter and a log line."""

    window: int = Field(default=5, ge=2)
    """Steps (trainer versions) compared by the trend monitors."""
    reward_rise: float = Field(default=0.25, gt=0)
    """Train reward (mean of `window` steps) rising by more than this between two held-out
    evaluations while held-out accuracy does not rise by `heldout_rise` fires
    `reward_without_heldout`. In healthy demo runs the sampled reward still rises by up to 0.15
    over one evaluation interval after greedy held-out accuracy has levelled off (sampling
    sharpens towards what greedy decoding already does); 0.25 leaves that room."""
    heldout_rise: float = Field(default=0.02, ge=0)
    length_jump: float = Field(default=1.5, gt=1)
    """Mean completion length growing by this factor between consecutive windows fires `length_jump`."""
    repetition_jump: float = Field(default=0.2, gt=0)
    """Mean repeated-4-gram fraction rising by this much between windows fires `repetition_jump`."""
    peer_alpha: float = Field(default=1e-6, gt=0, lt=1)
    """False-alarm probability of one `worker_outlier` check, split over the workers compared
    (Bonferroni): the one-sided threshold is the normal quantile at 1 - peer_alpha / workers (4.9
    sigma for two workers, 5.1 for five). A check runs at every step over a window that moves by
    a few versions, so a run makes hundreds of overlapping checks: simulated with calibrated
    per-version noise, 600 checks of two honest workers fire in 0.05 % of runs at this default
    (1.3 % at 1e-4, whose 3.9 sigma one of three recorded healthy demos crossed once, at 4.0)."""
    peer_min_groups: int = Field(default=16, ge=2)
    """Groups a worker needs, at versions its peers also ran, before it is compared with them."""
    peer_rearm_sigmas: float = 1.0
    """A flagged worker fires `worker_outlier` again only after falling back below this many sigmas."""
    max_filtered_fraction: float = Field(default=0.9, gt=0, le=1)
    """DAPO dynamic sampling dropping at least this fraction of the groups that finished over the
    last `window` steps fires `groups_filtered`."""
    filtered_min_groups: int = Field(default=20, ge=1)
    """Groups (dropped plus trained) over those steps before `groups_filtered` is judged."""


class RewardConfig(Section):
    terms: list[RewardTerm] = [RewardTerm()]
    """The rubric: gates, then the weighted sum of the other terms."""
    pool_size: int = Field(default=2, ge=1, le=256)
    """Scoring processes on the coordinator's machine."""
    timeout_seconds: float = Field(default=30.0, gt=0)
    """Wall-clock limit of scoring one rollout; past it the process is killed and the rollout is
    rejected (`scoring_failed`), its slot leased again."""
    max_output_bytes: int = Field(default=65536, ge=1024)
    """Largest result (score, diagnostics, flags) a scoring call may return."""
    max_memory_mb: int | None = Field(default=2048, ge=64)
    """RLIMIT_AS of each scoring process (a `9^{9^{9}}` answer fails instead of eating the host)."""
    zero_flagged: bool = False
    """Give 0 to every rollout in which a known hacking pattern was seen."""
    monitors: RewardMonitorConfig = RewardMonitorConfig()
