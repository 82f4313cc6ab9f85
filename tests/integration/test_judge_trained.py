"""A judge trained by `train_judge`, served by `decentrl serve` as a real process on loopback and
called by the judge reward through the `openai` client: right answers get the positive verdict,
near misses the negative one, and a repeated answer is served from the cache without a call. The
breakout corpus (benchmarks/judge/) wrapped around wrong answers earns no CORRECT:
neither from the model shown the escaped field alone, nor from the judge reward."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("openai")

from serving import served  # noqa: E402

from benchmarks.judge.measure import TASK, breakout_cases  # noqa: E402
from decentrl.config import ModelConfig  # noqa: E402
from decentrl.envs import environment_from_config  # noqa: E402
from decentrl.rewards.judge import JudgeReward, completion_prompt, parse_verdict  # noqa: E402
from decentrl.rewards.train_judge import greedy_verdicts, judge_examples, train_judge  # noqa: E402

pytestmark = pytest.mark.integration
MODEL = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("judge")
    train_judge(environment_from_config(TASK), MODEL, out, steps=200, batch_size=32, num_eval=64)
    return out


@pytest.fixture(scope="module")
def server(judge_dir):
    with served(judge_dir, "judge") as url:
        yield url


def test_examples_are_balanced_prompts_with_strict_verdicts():
    env = environment_from_config(TASK)
    examples = judge_examples(env, "train", 200)
    verdicts = [verdict for _, verdict in examples]
    assert set(verdicts) == {" CORRECT", " INCORRECT"} and 60 < verdicts.count(" CORRECT") < 140
    for prompt, verdict in examples[:20]:
        assert prompt.endswith("VERDICT:") and parse_verdict("VERDICT:" + verdict) is not None
        reference = re.search(r"<reference>\n(.*)\n</reference>", prompt)[1]
        candidate = json.loads(re.search(r"<candidate>\n(.*)\n</candidate>", prompt)[1])
        assert (candidate == reference) == (verdict == " CORRECT")


@pytest.mark.slow  # training the judge takes a minute or more on 2 cores
def test_train_judge_reports_held_out_accuracy(judge_dir):
    report = json.loads((judge_dir / "train_judge.json").read_text())
    assert report["steps"] == 200 and report["heldout_examples"] == 64
    assert report["heldout_accuracy"] >= 0.75  # chance is 0.5; an unparseable verdict counts as wrong
    assert (judge_dir / "config.json").is_file() and (judge_dir / "tokenizer.json").is_file()


@pytest.mark.slow
def test_served_judge_says_correct_to_right_answers_and_caches(server):
    env = environment_from_config(TASK)
    judge = JudgeReward(base_url=server, model="judge", prompt="completion", max_tokens=12)
    problems = [env.problem(seed, "eval") for seed in range(8)]
    right = [judge.judge(p.text, p.answer, p.answer) for p in problems]
    # Every verdict parsed at the first call (or came from the cache: eval problems may repeat).
    assert all(s.diagnostics.get("retries", 0.0) == 0.0 and "unparsed" not in s.diagnostics for s in right)
    assert sum(s.value for s in right) >= 7, [s.value for s in right]  # the positive verdict, 1.0
    wrong = [judge.judge(p.text, p.answer, p.answer + "1") for p in problems]
    assert sum(s.value for s in wrong) <= 1, [s.value for s in wrong]
    calls = judge.calls
    again = judge.judge(problems[0].text, problems[0].answer, f"  {problems[0].answer} ")
    assert again.value == right[0].value and again.diagnostics == {"cached": 1.0}
    assert judge.calls == calls  # served from the cache: no request reached the server


@pytest.mark.slow
def test_trained_judge_says_incorrect_to_every_breakout_of_a_wrong_answer(judge_dir, server):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    env = environment_from_config(TASK)
    cases = breakout_cases(env, 6)
    # The model alone, on the escaped field (no hard fails before it): every verdict INCORRECT.
    model = AutoModelForCausalLM.from_pretrained(judge_dir).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(judge_dir)
    verdicts = greedy_verdicts(
        model, tokenizer, [completion_prompt(p.text, p.answer, text) for p, _, text in cases]
    )
    fooled = sorted(
        {name for (_, name, _), verdict in zip(cases, verdicts, strict=True) if verdict is not False}
    )
    assert len(cases) >= 30 * 6 and fooled == [], fooled
    # The judge reward over the served judge: every one scores 0.
    judge = JudgeReward(base_url=server, model="judge", prompt="completion", max_tokens=12)
    scores = [judge.judge(p.text, p.answer, text) for p, _, text in cases[::7]]
    assert all(score.value == 0.0 for score in scores) and judge.calls > 0
