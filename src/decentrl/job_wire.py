"""Wire types of the trusted roles that check accepted rollouts: the jobs they pull and what they
post back. A verifier recomputes a sampled rollout's log-probs and reports a `Verdict`
(docs/security.md); a scorer scores rollouts with its reward model, one rubric term each
(docs/rewards.md). The coordinator decides what either means.

Part of the wire types `protocol.py` gathers; imports neither torch nor any role.
"""

from __future__ import annotations

from pydantic import Field

from decentrl.image_wire import RolloutImage
from decentrl.registration_wire import DeclaredDtype
from decentrl.rollout_wire import Segment, StageTrace
from decentrl.stage_map import StageMap
from decentrl.wire import Label, Wire

# ---------------------------------------------------------------- verification (trusted verifier)


class VerifyJobsRequest(Wire):
    max_jobs: int = Field(default=16, ge=1, le=1024)
    dtype: DeclaredDtype = "float32"
    """The verifier's compute dtype: a job's tolerance is the looser of its worker's engine class
    and this dtype's (a bf16 recomputation errs like a bf16 engine)."""


class VerifyJob(Wire):
    """One accepted rollout whose claims a trusted verifier recomputes (docs/security.md)."""

    rollout_id: str
    temperature: float
    prompt_token_ids: list[int]
    segments: list[Segment]
    """As submitted: every model token carries the version it claims to come from."""
    pit_seed: int
    """Seed of the randomised probability integral transform; unknown to the worker."""
    stage_traces: list[StageTrace] | None = None
    """A staged rollout's traces: the verifier recomputes each stage on its committed inputs and
    blames the first whose answer diverges."""
    stage_map: StageMap | None = None
    tolerance_mean: float = Field(default=0.002, gt=0.0)
    """The mean log-prob error per token allowed (the worker's engine class's, or the verifier's
    dtype's if looser): the null of the mean test whose log-evidence the verifier reports
    (trust/logprob_tolerance.py)."""
    images: list[RolloutImage] | None = None
    """The rollout's images as accepted; the verifier draws them from `seed`."""
    seed: int | None = None
    """The task's seed, sent with images."""


class VerifyJobs(Wire):
    jobs: list[VerifyJob]


class Verdict(Wire):
    """What the verifier measured for one rollout; the coordinator decides what it means."""

    rollout_id: Label = Field(..., max_length=64)
    num_tokens: int = Field(default=0, ge=0)
    max_logprob_error: float = Field(default=0.0, ge=0.0)
    """max over model tokens of |claimed - recomputed| log-prob under the claimed version."""
    mean_logprob_error: float = Field(default=0.0, ge=0.0)
    """Mean over the compared model tokens of |claimed - recomputed| log-prob."""
    logprob_tokens: int = Field(default=0, ge=0)
    """Model tokens compared (greedy ones too; `num_tokens` counts the sampled ones of `pit_sums`)."""
    error_log_evidence: float = Field(default=0.0, allow_inf_nan=False)
    """Sum over the compared tokens of log(1 + bet (min(error, CLIP) - tolerance_mean)): the mean
    test's evidence from this rollout (trust/logprob_tolerance.py)."""
    pit_sums: list[float] = Field(default_factory=list, max_length=8)
    """Sums over model tokens of the orthonormal Legendre polynomials 1..k of the randomised PIT value
    (uniform on [0, 1] for honestly sampled tokens)."""
    unverifiable: str | None = Field(default=None, max_length=200)
    """Why the rollout could not be checked (e.g. its version's weights were pruned)."""
    version_tokens: int = Field(default=0, ge=0)
    """Model tokens also recomputed under the version before the one they claim."""
    version_log_evidence: float = Field(default=0.0, allow_inf_nan=False)
    """The version test's log-evidence from those tokens: high when the previous version explains
    the claimed log-probs better than the claimed one (verifier/version_check.py)."""
    blame_stage: int | None = Field(default=None, ge=0, le=1024)
    """A staged rollout: the first stage whose answer on its committed inputs diverged from the
    recomputation (0: the driver's own stage); None when every stage agreed."""
    blame_detail: str | None = Field(default=None, max_length=200)


class VerdictBatch(Wire):
    verdicts: list[Verdict] = Field(..., max_length=1024)
    compute_seconds: float = Field(default=0.0, ge=0.0)
    """Verifier compute spent on these verdicts (forward passes), for the overhead metric."""
    dtype: DeclaredDtype = "float32"
    """The verifier's compute dtype (as in `VerifyJobsRequest`)."""


# ---------------------------------------------------------------- reward scoring (trusted scorer)


class ScoreJobsRequest(Wire):
    max_jobs: int = Field(default=64, ge=1, le=1024)
    term: Label | None = Field(default=None, max_length=64)
    """Only jobs of this rubric term (a scorer serves one reward model); None: any term."""


class ScoreJob(Wire):
    """One accepted rollout a trusted scorer (`decentrl scorer`) scores with its reward model."""

    rollout_id: str
    term: str
    """The rubric term (`[[reward.terms]]` label) the score is for."""
    prompt: str
    """The problem's prompt as text (chat prompts: the last message's content)."""
    answer: str
    """The final assistant turn, decoded from the rollout's token ids by the coordinator."""


class ScoreJobs(Wire):
    jobs: list[ScoreJob]


class TermScore(Wire):
    rollout_id: Label = Field(..., max_length=64)
    term: Label = Field(..., max_length=64)
    value: float = Field(..., allow_inf_nan=False)


class TermScoreBatch(Wire):
    scores: list[TermScore] = Field(..., max_length=1024)
    compute_seconds: float = Field(default=0.0, ge=0.0)
