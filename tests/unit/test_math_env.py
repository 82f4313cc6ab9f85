"""The math environment and its grader: equivalent forms are right, the gold answer is boxed."""

from __future__ import annotations

import random

import pytest

from decentrl.envs import load_environment
from decentrl.envs.base import TeacherHabits
from decentrl.envs.mathematics.grading import grade


@pytest.mark.parametrize(
    ("answer", "gold"),
    [
        ("\\boxed{0.5}", "\\frac{1}{2}"),
        ("so \\boxed{19/12}", "\\frac{19}{12}"),
        ("\\boxed{1.583333}", "\\frac{19}{12}"),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
        ("\\boxed{x = -4}", "-4"),
        ("\\boxed{1,000}", "1000"),
    ],
)
def test_equivalent_forms_are_right(answer, gold):
    assert grade(answer, gold).correct


def test_problems_are_deterministic_disjoint_and_their_gold_scores_one():
    env = load_environment("math", kinds=["linear", "fraction", "power"])
    train = [env.problem(seed, "train") for seed in range(200)]
    held_out = {env.problem(seed, "eval").text for seed in range(200)}
    assert [p.text for p in train] == [env.problem(seed, "train").text for seed in range(200)]
    assert not {p.text for p in train} & held_out
    assert {p.text.split()[0] for p in train} == {"Solve", "Compute"}
    assert all(env.score(p, f"\\boxed{{{p.answer}}}") == 1.0 for p in train[:50])
    assert all(env.score(p, p.answer) == 0.0 for p in train[:50])  # no box, no reward


def test_the_teacher_has_the_configured_habits():
    env = load_environment("math")
    rng = random.Random(0)
    teacher = TeacherHabits(carry_drop=0.5, zero_pad=0.2)
    problems = [env.problem(seed, "train") for seed in range(300)]
    scores = [env.score(p, env.demonstration(p, rng, teacher)[0]) for p in problems]
    assert 0.25 < sum(scores) / len(scores) < 0.55  # about 0.8 boxed * 0.5 right signs (+ x = 0)


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="math kinds must be among"):
        load_environment("math", kinds=["calculus"])


def test_grading_off_the_main_thread_still_works():
    """math-verify's own timeouts need the main thread; a trainer evaluating in a thread still grades."""
    import threading

    results = []
    thread = threading.Thread(
        target=lambda: results.extend([grade("\\boxed{0.5}", "\\frac{1}{2}"), grade("\\boxed{7}", "1")])
    )
    thread.start()
    thread.join()
    assert [r.correct for r in results] == [True, False]
