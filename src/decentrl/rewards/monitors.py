"""Reward-hacking monitors: statistics over recent steps and workers that should not move.

Each check is a pure function of numbers the coordinator already has; the coordinator runs them
when the trainer reports a step (`coordinator/pipeline/scoring.py`) and turns each alarm into a
`reward_alarm` event on /v1/stats, a Prometheus counter and a line in the trainer's log.

- `reward_without_heldout`: train reward rose by `reward_rise` over the last `window` steps while
  held-out accuracy did not rise by `heldout_rise`: the policy found something the reward pays
  for that is not the task (the classic overoptimisation signature, Gao et al. 2022,
  arXiv 2210.10760).
- `length_jump` / `repetition_jump`: the mean answer length (repeated-4-gram fraction) of the
  latest window is `length_jump` times (`repetition_jump` above) that of the window before:
  padding and looping are how policies game length-blind judges and reward models.
- `hack_pattern`: a known hack (`patterns.Hack`) appeared in a scored answer (counted per pattern).
- `worker_outlier`: a worker's rollouts score far above its peers' at the same policy versions
  (`rewards/outliers.py`: groups as units, Bonferroni over workers, hysteresis).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from decentrl.config.rewards import RewardMonitorConfig


class Alarm(StrEnum):
    REWARD_WITHOUT_HELDOUT = "reward_without_heldout"
    LENGTH_JUMP = "length_jump"
    REPETITION_JUMP = "repetition_jump"
    HACK_PATTERN = "hack_pattern"
    WORKER_OUTLIER = "worker_outlier"
    GROUPS_FILTERED = "groups_filtered"


@dataclass(frozen=True)
class StepStats:
    """One trainer step as the monitors see it."""

    version: int
    reward: float
    """Mean reward of the step's rollouts."""
    answer_chars: float
    repetition: float
    heldout: float | None = None
    """Held-out accuracy when the trainer evaluated at this step."""


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def groups_filtered(filtered: int, trained: int, config: RewardMonitorConfig) -> str | None:
    """DAPO's dynamic sampling drops every group whose rewards are all equal. When nearly every
    finished group is dropped, the workers sample many groups per trained one and the few that
    train decide the update: the problems are too easy or too hard for the policy, or the reward
    cannot tell its answers apart."""
    total = filtered + trained
    if total < config.filtered_min_groups or filtered < config.max_filtered_fraction * total:
        return None
    return (
        f"dynamic sampling dropped {filtered} of the last {total} groups ({filtered / total:.0%}): "
        "their rewards were all equal"
    )


def reward_without_heldout(steps: Sequence[StepStats], config: RewardMonitorConfig) -> str | None:
    """Judged only at a step that brings a new held-out evaluation, against the last evaluation at
    least `window` steps earlier. The train reward at each end is the mean over the `window` steps
    ending there: one step's mean reward moves by ±0.1 with nothing learned (a batch of 128
    rollouts of 16 problems), and between two evaluations the held-out number is stale, so a
    step-to-step comparison fires on noise in a healthy run."""
    if len(steps) < config.window or steps[-1].heldout is None:
        return None
    latest = steps[-1]
    earlier = [s for s in steps[: -config.window] if s.heldout is not None]
    if not earlier:
        return None
    anchor = earlier[-1]
    versions = [s.version for s in steps]
    at_anchor = versions.index(anchor.version)
    reward_then = _mean([s.reward for s in steps[max(0, at_anchor + 1 - config.window) : at_anchor + 1]])
    reward_now = _mean([s.reward for s in steps[-config.window :]])
    reward_rise = reward_now - reward_then
    heldout_rise = latest.heldout - anchor.heldout  # pyright: ignore[reportOperatorIssue]
    if reward_rise > config.reward_rise and heldout_rise < config.heldout_rise:
        return (
            f"train reward +{reward_rise:.3f} between versions {anchor.version} and {latest.version} "
            f"(means of {config.window} steps) while held-out moved {heldout_rise:+.3f}"
        )
    return None


def jumps(steps: Sequence[StepStats], config: RewardMonitorConfig) -> list[tuple[Alarm, str]]:
    """Length and repetition of the latest window against the window before it."""
    if len(steps) < 2 * config.window:
        return []
    before, latest = steps[-2 * config.window : -config.window], steps[-config.window :]
    alarms = []
    length_before, length_now = (
        _mean([s.answer_chars for s in before]),
        _mean([s.answer_chars for s in latest]),
    )
    if length_before > 0 and length_now > config.length_jump * length_before:
        alarms.append(
            (Alarm.LENGTH_JUMP, f"mean answer length {length_before:.1f} -> {length_now:.1f} chars")
        )
    repeat_before, repeat_now = _mean([s.repetition for s in before]), _mean([s.repetition for s in latest])
    if repeat_now - repeat_before > config.repetition_jump:
        alarms.append((Alarm.REPETITION_JUMP, f"repeated 4-grams {repeat_before:.2f} -> {repeat_now:.2f}"))
    return alarms
