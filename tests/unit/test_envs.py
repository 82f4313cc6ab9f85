"""The arithmetic environment, the warm-start teacher and the character tokenizer."""

from __future__ import annotations

import random
import re

import pytest
from transformers import AutoTokenizer

from decentrl.envs import Problem, make_env
from decentrl.envs.arithmetic import add_without_carry, teacher_answer
from decentrl.model.tokenizer import build_char_tokenizer

PROBLEM = re.compile(r"^(\d+)([+\-*])(\d+)=$")
NUM_SEEDS = 3000


def true_answer(prompt: str) -> int:
    """Parse `a op b=` and compute with plain int arithmetic (no eval)."""
    match = PROBLEM.match(prompt)
    assert match, prompt
    a, op, b = int(match[1]), match[2], int(match[3])
    return {"+": a + b, "-": a - b, "*": a * b}[op]


# ---------------------------------------------------------------- arithmetic env


def test_problems_are_deterministic() -> None:
    env = make_env("arithmetic", num_digits=2, operations="+")
    other = make_env("arithmetic", num_digits=2, operations="+")
    for split in ("train", "eval"):
        first = [env.problem(seed, split) for seed in range(50)]
        assert first == [env.problem(seed, split) for seed in range(50)]
        assert first == [other.problem(seed, split) for seed in range(50)]
        assert len({p.prompt for p in first}) > 10  # different seeds, different problems
        assert all(p.split == split for p in first)


def test_train_and_eval_problems_are_disjoint() -> None:
    env = make_env("arithmetic", num_digits=2, operations="+")
    train = {env.problem(seed, "train").prompt for seed in range(NUM_SEEDS)}
    held_out = {env.problem(seed, "eval").prompt for seed in range(NUM_SEEDS)}
    assert len(train) > 1000 and len(held_out) > 100
    assert train.isdisjoint(held_out)


@pytest.mark.parametrize("operations", ["+", "+-*"])
def test_answers_are_correct(operations: str) -> None:
    env = make_env("arithmetic", num_digits=3, operations=operations)
    seen_ops = set()
    for seed in range(300):
        for split in ("train", "eval"):
            problem = env.problem(seed, split)
            assert problem.answer == str(true_answer(problem.prompt))
            assert all(len(operand) <= 3 for operand in re.split(r"[+\-*=]", problem.prompt) if operand)
            seen_ops.add(PROBLEM.match(problem.prompt)[2])
    assert seen_ops == set(operations)


def test_score_is_exact_match() -> None:
    env = make_env("arithmetic", num_digits=3, operations="+")
    problem = Problem(seed=0, split="train", prompt="317+48=", answer="365")
    assert env.score(problem, "365") == 1.0
    assert env.score(problem, " 365\n") == 1.0  # surrounding whitespace is not a mistake
    assert env.score(problem, "0365") == 0.0
    assert env.score(problem, "36") == 0.0
    assert env.score(problem, "3655") == 0.0
    assert env.score(problem, "3 65") == 0.0
    assert env.score(problem, "") == 0.0


def test_unknown_env_names_the_available_ones() -> None:
    with pytest.raises(ValueError, match="sudoku") as error:
        make_env("sudoku")
    assert "arithmetic" in str(error.value)


# ---------------------------------------------------------------- warm-start teacher


def test_add_without_carry() -> None:
    assert add_without_carry(57, 68) == 15  # 7+8=15 -> 5, 5+6=11 -> 1
    assert add_without_carry(5, 5) == 0
    assert add_without_carry(123, 9) == 122  # 3+9=12 -> 2; 2 and 1 unchanged
    assert add_without_carry(12, 34) == 46  # no carry: the true sum
    assert add_without_carry(0, 0) == 0


def test_perfect_teacher_is_always_right() -> None:
    env = make_env("arithmetic", num_digits=2, operations="+")
    for seed in range(500):
        problem = env.problem(seed, "train")
        assert teacher_answer(problem, random.Random(seed), carry_drop=0.0) == str(
            true_answer(problem.prompt)
        )


def test_forgetful_teacher_drops_carries() -> None:
    carry = Problem(seed=0, split="train", prompt="57+68=", answer="125")
    no_carry = Problem(seed=0, split="train", prompt="12+34=", answer="46")
    for seed in range(20):
        assert teacher_answer(carry, random.Random(seed), carry_drop=1.0) == "15"
        assert teacher_answer(no_carry, random.Random(seed), carry_drop=1.0) == "46"
        assert teacher_answer(carry, random.Random(seed), carry_drop=0.0) == "125"


# ---------------------------------------------------------------- character tokenizer

PRINTABLE = "".join(chr(code) for code in range(32, 127))


def test_char_tokenizer_special_ids_and_no_bos() -> None:
    tokenizer = build_char_tokenizer()
    assert tokenizer.pad_token_id == 0
    assert tokenizer.eos_token_id == 1
    ids = tokenizer.encode("7+8=")
    assert len(ids) == 4  # one token per character, nothing prepended or appended
    assert ids == [tokenizer.convert_tokens_to_ids(c) for c in "7+8="]
    assert tokenizer.unk_token_id not in ids


@pytest.mark.parametrize(
    "text", [PRINTABLE, PRINTABLE[::-1], "  317 + 48 = 365  ", "a , b . c ' d n't !", "line one\nline two\n"]
)
def test_char_tokenizer_round_trips(text: str) -> None:
    tokenizer = build_char_tokenizer()
    ids = tokenizer.encode(text)
    assert len(ids) == len(text)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


def test_char_tokenizer_round_trips_consecutive_newlines() -> None:
    tokenizer = build_char_tokenizer()
    text = "a\n\nb"
    ids = tokenizer.encode(text)
    assert ids == [tokenizer.convert_tokens_to_ids(c) for c in text]
    assert tokenizer.decode(ids) == text


def test_char_tokenizer_survives_save_and_auto_load(tmp_path) -> None:
    tokenizer = build_char_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in (PRINTABLE, "12+34=46", " x y\n"):
        assert reloaded.encode(text) == tokenizer.encode(text)
        assert reloaded.decode(tokenizer.encode(text)) == text
    assert (reloaded.pad_token_id, reloaded.eos_token_id) == (0, 1)
    assert reloaded.bos_token_id is None


def test_the_runs_sandbox_section_reaches_the_environments_that_run_code() -> None:
    """`[sandbox]` sets the limits of the code a run scores (code, dataset, humaneval); an
    environment's own `task.args.sandbox` still wins, and one that runs no code gets none."""
    from decentrl.config import RunConfig
    from decentrl.envs import environment_from_config
    from decentrl.envs.registry import task_arguments

    run = RunConfig.model_validate({"task": {"env": "code"}, "sandbox": {"wall_seconds": 3.5}})
    assert environment_from_config(run.task, run.sandbox).sandbox.wall_seconds == 3.5  # type: ignore[attr-defined]
    own = RunConfig.model_validate(
        {
            "task": {"env": "code", "args": {"sandbox": {"wall_seconds": 7.0}}},
            "sandbox": {"wall_seconds": 3.5},
        }
    )
    assert environment_from_config(own.task, own.sandbox).sandbox.wall_seconds == 7.0  # type: ignore[attr-defined]
    arithmetic = RunConfig.model_validate({"sandbox": {"wall_seconds": 3.5}})
    assert "sandbox" not in task_arguments(arithmetic.task, arithmetic.sandbox)
