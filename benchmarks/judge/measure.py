"""How often a judge model says CORRECT to the breakout corpus wrapped around wrong answers.

    python -m benchmarks.judge.measure --model-dir DIR [--problems 10]

DIR is a judge trained by `decentrl train-judge` on the arithmetic task (1 digit, `+`), as in
tests/integration/test_judge_trained.py. The wrong answers are the near misses of held-out problems
that the task rejects; each is wrapped in every breakout, the model is shown the judge's
completion prompt directly (no hard fails before it) and its greedy verdict is read with the
judge's strict parser. Prints a JSON line: cases, CORRECT verdicts, unparseable ones, CORRECT per
breakout, and the same for the bare wrong and right answers.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from pathlib import Path

from benchmarks.judge.breakouts import breakouts
from decentrl.config import TaskConfig
from decentrl.envs import environment_from_config
from decentrl.envs.base import Environment, Problem
from decentrl.rewards.judge import completion_prompt
from decentrl.rewards.train_rm import near_misses

TASK = TaskConfig(env="arithmetic", args={"num_digits": 1, "operations": "+"})


def wrong_answers(env: Environment, num_problems: int) -> list[tuple[Problem, str]]:
    """(problem, wrong answer): near misses of held-out problems that the task rejects."""
    pairs = []
    for seed in range(num_problems):
        problem = env.problem(seed, "eval")
        misses = near_misses(problem.answer, random.Random(seed))
        score = getattr(env, "score")  # noqa: B009 - single-turn environments only, not part of Environment
        pairs += [(problem, miss) for miss in misses if score(problem, miss) == 0.0]
    return pairs


def breakout_cases(env: Environment, num_problems: int) -> list[tuple[Problem, str, str]]:
    """(problem, breakout name, candidate) for every breakout around every wrong answer; the fake
    reference a breakout claims is the answer + 3, never the answer."""
    return [
        (problem, name, text)
        for problem, wrong in wrong_answers(env, num_problems)
        for name, text in breakouts(wrong, str(int(problem.answer) + 3)).items()
    ]


def main(argv: list[str]) -> int:
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from decentrl.rewards.train_judge import greedy_verdicts

    parser = argparse.ArgumentParser(description="CORRECT verdicts of a judge model on the breakout corpus")
    parser.add_argument("--model-dir", required=True, type=Path)
    parser.add_argument("--problems", type=int, default=10)
    args = parser.parse_args(argv)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.model_dir)
    env = environment_from_config(TASK)

    def verdicts(cases: list[tuple[Problem, str]]) -> list[bool | None]:
        prompts = [completion_prompt(problem.text, problem.answer, text) for problem, text in cases]
        return greedy_verdicts(model, tokenizer, prompts)

    pairs = wrong_answers(env, args.problems)
    cases = breakout_cases(env, args.problems)
    said = verdicts([(problem, text) for problem, _, text in cases])
    result = {
        "cases": len(cases),
        "correct": said.count(True),
        "unparsed": said.count(None),
        "correct_by_breakout": dict(Counter(name for (_, name, _), v in zip(cases, said, strict=True) if v)),
        "bare_wrong_correct": verdicts(pairs).count(True),
        "bare_wrong": len(pairs),
        "right_correct": verdicts([(problem, problem.answer) for problem, _ in pairs]).count(True),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
