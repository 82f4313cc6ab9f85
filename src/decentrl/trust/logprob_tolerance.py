"""How far an honest worker's claimed log-probs may sit from the verifier's recomputation.

The verifier recomputes log-probs in float32 with the trainer's code. An honest engine differs from
that by an amount set by its arithmetic: ~1e-6 per token for a float32 engine (batching and
KV-cache order only); for a bfloat16 one ~0.01 per token on average with rare tokens off by one or
two nats (a sharp distribution amplifies rounded logits). So the tolerance is calibrated per
*engine class* ("engine/dtype/device", declared by the worker when it registers), not one constant,
and has two parts:

- `max`: the largest |claimed - recomputed| any one token may show; beyond it the rollout fails at
  once (tight for float32, loose for bfloat16, whose honest outliers a per-token bound cannot
  separate from forgery);
- `mean`: the largest mean error an honest engine of the class shows. The check on it is a test by
  betting over every token the verifier compares: each token multiplies the worker's evidence by
  `1 + bet * (min(error, CLIP) - mean)`, bet = BET / mean. When an honest worker's expected error
  per token is at most `mean`, each factor has mean <= 1, so the evidence is a test supermartingale
  and crosses 1/alpha with probability <= alpha over the worker's whole life, however the errors
  are distributed (outliers included); a forger whose errors average above `mean` grows it
  exponentially. The coordinator runs it as a CUSUM with alpha spent over verdict batches
  (`repeats.detector_step`), so a worker that starts forging after an honest period is caught on
  what it sends after the change.

Lookup goes from the most to the least specific key ("vllm/bfloat16/cuda", "vllm/bfloat16",
"*/bfloat16/cuda", "*/bfloat16"); a class the table does not know gets the loosest entry. Every
entry is bounded by `LOOSEST` (or the run's own `trust.loosest_tolerance`), so a worker that lies
about its dtype to get a looser tolerance gains at most that bound, under which forged log-probs
still fail (docs/security.md). `calibrate`
turns honest measurements (`decentrl bench engines`) into an entry; `CALIBRATED` holds the ones
measured for the shipped defaults (docs/engines.md). Imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LogprobTolerance(BaseModel):
    """One engine class's bounds on |claimed - recomputed| log-prob (natural log units)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    mean: float = Field(gt=0)
    """The largest expected error per token of an honest engine of the class (the mean test's null)."""
    max: float = Field(gt=0)
    """The largest error any one token may show; a rollout with a token beyond it fails at once."""

    @model_validator(mode="after")
    def _ordered(self) -> LogprobTolerance:
        if self.mean > self.max:
            raise ValueError(f"a tolerance's mean ({self.mean}) cannot exceed its max ({self.max})")
        return self

    @property
    def bet(self) -> float:
        """Stake per unit of error in the mean test: `BET / mean` keeps every factor >= 1 - BET."""
        return BET / self.mean

    def token_log_evidence(self, error: float) -> float:
        """log of one compared token's factor in the mean test (negative for an error below `mean`)."""
        return math.log1p(self.bet * (min(error, CLIP) - self.mean))

    def looser(self, other: LogprobTolerance) -> LogprobTolerance:
        """Each bound the larger of the two (a worker's class and the verifier's own dtype)."""
        return LogprobTolerance(mean=max(self.mean, other.mean), max=max(self.max, other.max))

    def failure(self, max_error: float) -> str | None:
        """Why a verdict fails the per-token bound, or None when it passes."""
        if max_error > self.max:
            return f"largest log-prob error {max_error:.3g} > {self.max:.3g}"
        return None


BET = 0.5
"""Fraction of the largest stake (1 / mean) the mean test bets per token: an exact token then costs
log(1 - BET) = -0.69 nats, a token erring by 3 x mean earns log(1 + 2 BET) = +0.69."""
CLIP = 1.0
"""Errors count at most this much in the mean test (nats): an honest outlier moves the evidence
by at most log(1 + BET (CLIP - mean) / mean)."""

LOOSEST = LogprobTolerance(mean=0.03, max=10.0)
"""No engine class, built in or configured, is looser unless the run raises this cap
(`trust.loosest_tolerance`): the most a worker lying about its engine, dtype or device can gain.
On the demo model, forged log-probs of the kind the benchmark tries (halved) err by 0.16 per token
on average, five times this mean, and a bias of 0.1 nats on every token is caught at once. A
larger model's honest bfloat16 engine can err by more (vLLM on SmolLM2-135M: 0.040 per token,
docs/engines.md); such a run calibrates its engines and raises the cap to what they need."""

CALIBRATED: dict[str, LogprobTolerance] = {
    # float32 engines agree with the float32 recomputation to < 1e-3 per token (hf 1.1e-5, vLLM on
    # CPU 7.1e-4 at most); the bounds keep a margin of > 10x.
    "*/float32": LogprobTolerance(mean=0.002, max=0.01),
    # bfloat16: vLLM on CPU, demo model, mean 0.016 and max 2.2 per token (docs/engines.md).
    "*/bfloat16": LogprobTolerance(mean=0.03, max=10.0),
    # float16 (three more mantissa bits): vLLM on CPU, demo model, mean 0.0023, p99 0.028 and max
    # 0.33 per token over 14,521 tokens; the bounds keep a margin of 4x and 6x.
    "*/float16": LogprobTolerance(mean=0.01, max=2.0),
    # A pipeline of float32 stages whose hidden states cross each boundary in bfloat16 or int8
    # (worker/pipeline_engine.py, registered as "pipeline-<codec>"), 2 stages: bfloat16 on the
    # warm-started demo model (512 rollouts) mean 5.5e-4, max 0.021 per token, on SmolLM2-135M
    # (256) mean 2.1e-3, max 0.012; int8 on the demo model mean 3.0e-3, p99 0.045, max 0.13 (on
    # SmolLM2 mean 0.20: its outlier channels, beyond LOOSEST; docs/pipeline.md). Margin 3x.
    "pipeline-bfloat16/float32": LogprobTolerance(mean=0.007, max=0.07),
    "pipeline-int8/float32": LogprobTolerance(mean=0.01, max=0.4),
}
"""The shipped table, from honest measurements with `calibrate` (docs/engines.md)."""

ANY_ENGINE = "*"


def engine_class(engine: str, dtype: str, device: str) -> str:
    return f"{engine}/{dtype}/{device}"


def check_bounded(entries: Mapping[str, LogprobTolerance], loosest: LogprobTolerance = LOOSEST) -> None:
    """Refuse an entry looser than `loosest` (a ValueError naming the entry and the bound): the
    shipped `LOOSEST` or a run's `trust.loosest_tolerance`."""
    for key, entry in entries.items():
        if len(key.split("/")) not in (2, 3) or not all(key.split("/")):
            raise ValueError(
                f"tolerance key {key!r} must read 'engine/dtype' or 'engine/dtype/device' ('*' = any engine)"
            )
        if entry.mean > loosest.mean or entry.max > loosest.max:
            raise ValueError(
                f"tolerance {key!r} ({entry.mean}, {entry.max}) is looser than the bound every engine class "
                f"keeps ({loosest.mean}, {loosest.max}); calibrate the engine to agree better with the verifier, "
                "or raise trust.loosest_tolerance (every worker can then claim that much; docs/security.md)"
            )


class ToleranceTable:
    """The tolerances in force for one run: the calibrated table with the run's own entries over it."""

    def __init__(self, entries: Mapping[str, LogprobTolerance], loosest: LogprobTolerance = LOOSEST):
        assert entries, "a tolerance table needs at least one entry"
        check_bounded(entries, loosest)
        self.entries = dict(sorted(entries.items()))

    @classmethod
    def for_run(
        cls,
        overrides: Mapping[str, LogprobTolerance],
        stored: Mapping | None = None,
        loosest: LogprobTolerance = LOOSEST,
    ) -> ToleranceTable:
        """`stored` (the table a run started with, if any) or the calibrated one, then `overrides`,
        every entry within `loosest`."""
        base = CALIBRATED if stored is None else {k: LogprobTolerance(**v) for k, v in stored.items()}
        return cls({**base, **overrides}, loosest)

    def lookup(self, engine: str, dtype: str, device: str) -> tuple[str, LogprobTolerance]:
        """The most specific entry for a declared class, with its key; the loosest for an unknown one."""
        for key in (
            f"{engine}/{dtype}/{device}",
            f"{engine}/{dtype}",
            f"{ANY_ENGINE}/{dtype}/{device}",
            f"{ANY_ENGINE}/{dtype}",
        ):
            if key in self.entries:
                return key, self.entries[key]
        return max(self.entries.items(), key=lambda item: (item[1].max, item[1].mean))

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {key: entry.model_dump() for key, entry in self.entries.items()}


def _round_up(value: float) -> float:
    """Up to two significant digits, so a table reads cleanly and never sits below the measurement."""
    if value <= 0:
        return value
    scale = 10 ** (math.floor(math.log10(value)) - 1)
    return math.ceil(value / scale - 1e-9) * scale


def calibrate(errors_per_rollout: Iterable[Sequence[float]], margin: float = 3.0) -> dict:
    """An entry from honest rollouts' per-token |claimed - recomputed| errors, and what it rests on.

    `mean` is `margin` times the mean token error and `max` `margin` times the largest one, both
    rounded up. `mean_test_nats_per_token` is the mean test's drift on these rollouts (it must be
    well below 0 for honest ones)."""
    rollouts = [list(errors) for errors in errors_per_rollout if len(errors)]
    tokens = [error for errors in rollouts for error in errors]
    if not tokens:
        raise ValueError("calibration needs at least one honest rollout with a model token")
    floor = 1e-6  # a bit-exact engine still gets a positive tolerance
    average, largest = sum(tokens) / len(tokens), max(tokens)
    entry_max = _round_up(max(margin * largest, floor))
    entry = LogprobTolerance(mean=min(_round_up(max(margin * average, floor)), entry_max), max=entry_max)
    ordered = sorted(tokens)
    return {
        "rollouts": len(rollouts),
        "tokens": len(tokens),
        "token_error_mean": average,
        "token_error_p99": ordered[int(0.99 * (len(ordered) - 1))],
        "token_error_max": largest,
        "margin": margin,
        "tolerance": entry.model_dump(),
        "mean_test_nats_per_token": sum(entry.token_log_evidence(e) for e in tokens) / len(tokens),
        "within_bound": entry.mean <= LOOSEST.mean and entry.max <= LOOSEST.max,
    }
