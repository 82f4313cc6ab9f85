"""Rubrics: gates and weighted sums against hand-computed values, terms built from `[reward]`."""

from __future__ import annotations

import pytest

from decentrl.config import load_config
from decentrl.config.rewards import RewardConfig
from decentrl.envs import load_environment
from decentrl.rewards.rubric import Rubric, ScoreJob


def _rubric(terms: list[dict], env: str = "math") -> Rubric:
    return Rubric(RewardConfig.model_validate({"terms": terms}), load_environment(env))


def _job(env, answer: str, seed: int = 3) -> ScoreJob:
    problem = env.problem(seed, "train")
    return ScoreJob(
        "r",
        seed,
        "train",
        [{"role": "user", "content": problem.text}, {"role": "assistant", "content": answer}],
    )


def test_weighted_sum_and_gate_by_hand():
    rubric = _rubric(
        [
            {"function": "format", "gate": 1.0},
            {"function": "math_verify", "weight": 2.0},
            {"function": "overlong", "weight": 0.5, "args": {"max_chars": 20, "buffer_chars": 10}},
            {"function": "exact_match", "weight": 0.0},
        ]
    )
    gold = rubric.env.problem(3, "train").answer
    right = rubric.score_local(_job(rubric.env, f"\\boxed{{{gold}}}"))
    assert right.terms["math_verify"] == 1.0 and right.terms["overlong"] == 0.0
    assert rubric.combine(right.terms) == pytest.approx(2.0)
    # 25 characters: 15 past the 10 free ones, over a 10-character buffer -> the full -1 penalty.
    long_right = rubric.score_local(_job(rubric.env, f"{'x' * (22 - len(gold))}\\boxed{{{gold}}}"))
    assert long_right.terms["overlong"] == pytest.approx(
        -min((len(f"{'x' * (22 - len(gold))}\\boxed{{{gold}}}") - 10) / 10, 1)
    )
    assert rubric.combine(long_right.terms) == pytest.approx(2.0 + 0.5 * long_right.terms["overlong"])
    unboxed = rubric.score_local(_job(rubric.env, gold))
    assert unboxed.terms["format"] == 0.0 and rubric.combine(unboxed.terms) == 0.0  # gate closed
    assert unboxed.diagnostics["math_verify.no_box"] == 1.0
    assert unboxed.diagnostics["answer_chars"] == len(gold)


def test_default_rubric_is_the_environment_reward():
    rubric = Rubric(RewardConfig(), load_environment("arithmetic"))
    problem = rubric.env.problem(0, "train")
    job = ScoreJob(
        "r",
        0,
        "train",
        [{"role": "user", "content": problem.text}, {"role": "assistant", "content": problem.answer}],
    )
    assert rubric.score_local(job).terms == {"env": 1.0}


def test_reward_section_from_toml(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        '[task]\nenv = "math"\n[reward]\nzero_flagged = true\n'
        '[[reward.terms]]\nfunction = "math_verify"\n[[reward.terms]]\nfunction = "format"\ngate = 1.0\n'
    )
    config = load_config(path)
    assert [t.function.value for t in config.reward.terms] == ["math_verify", "format"]
    assert config.reward.zero_flagged


def test_unknown_function_and_bad_args_name_the_fix(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[[reward.terms]]\nfunction = "vibes"\n')
    with pytest.raises(ValueError, match="reward.terms.0.function"):
        load_config(path)
    with pytest.raises(ValueError, match="overlong.*check its `args`"):
        _rubric([{"function": "overlong", "args": {"max_tokens": 3}}])
    with pytest.raises(ValueError, match="distinct names"):
        _rubric([{"function": "format"}, {"function": "format"}])
