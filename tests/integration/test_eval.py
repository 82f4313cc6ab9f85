"""`decentrl eval` as a user runs it: on a model directory (one JSON line + a table), and on an
OpenAI-compatible endpoint (`decentrl serve`, a real process) where the greedy episodes must be
the very ones the in-process engine plays."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from serving import served

from decentrl.config import ModelConfig, TaskConfig
from decentrl.engines.endpoint import EndpointEngine
from decentrl.engines.hf import HFEngine
from decentrl.envs import environment_from_config
from decentrl.envs.chat import ChatFormat
from decentrl.eval.evaluate import evaluate
from decentrl.model.tiny import build_tiny, save_model_dir

pytestmark = pytest.mark.integration
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_dir(*build_tiny(ModelConfig()), tmp_path_factory.mktemp("eval-model"))


def test_eval_cli_reports_greedy_pass_at_k_and_avg_at_k(model_dir, tmp_path):
    answers_path = tmp_path / "out" / "answers.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "decentrl", "eval", str(model_dir), "--samples", "3"]
        + ["--set", "task.eval_size=12", "--set", "eval.batch_size=8", "--answers", str(answers_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["num_problems"] == 12 and report["num_samples"] == 3 and report["env"] == "arithmetic"
    for name in ("pass@1_greedy", "pass@3", "avg@3"):
        score = report[name]
        assert 0.0 <= score["low"] <= score["value"] <= score["high"] <= 1.0, (name, score)
        assert name in done.stdout.split("\n{")[0]  # the table lists it
    assert report["pass@3"]["value"] >= report["avg@3"]["value"]  # any-of-k is at least the mean
    # --answers: each greedy answer, from which the report's greedy and finished scores follow.
    answers = [json.loads(line) for line in answers_path.read_text().splitlines()]
    assert [a["index"] for a in answers] == list(range(12))
    assert {a["source"] for a in answers} == {str(model_dir)} and {a["env"] for a in answers} == {
        "arithmetic"
    }
    assert report["pass@1_greedy"]["value"] == sum(a["reward"] for a in answers) / 12
    # A single-turn answer is finished when its one turn ended with an end-of-turn token.
    assert all(a["finished"] == (a["stop"] == "max_turns") for a in answers), answers
    finished = [a for a in answers if a["finished"]]
    assert report["finished"]["value"] == len(finished) / 12
    if finished:
        assert report["pass@1_greedy_finished"]["value"] == sum(a["reward"] for a in finished) / len(finished)


def test_an_answers_path_that_cannot_be_written_is_one_clear_line(model_dir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "decentrl",
            "eval",
            str(model_dir),
            "--answers",
            str(blocker / "answers.jsonl"),
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "cannot write --answers" in done.stderr and "Traceback" not in done.stderr


def test_bad_source_is_one_clear_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "decentrl", "eval", str(tmp_path)], capture_output=True, text=True, env=ENV
    )
    assert done.returncode == 2
    assert "neither a model directory" in done.stderr and "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def endpoint(model_dir):
    with served(model_dir, "tiny") as url:
        yield url


def test_endpoint_plays_the_same_greedy_episodes_as_the_local_engine(model_dir, endpoint):
    torch.manual_seed(0)
    env = environment_from_config(TaskConfig())
    local = HFEngine.from_model_dir(model_dir, device="cpu")
    local.model.load_state_dict(build_tiny(ModelConfig())[0].state_dict())  # the saved weights
    chat = ChatFormat.from_model_dir(model_dir, local.eos_token_ids)
    remote = EndpointEngine(endpoint, chat.tokenizer, chat.eos_token_ids)
    assert remote.model == "tiny"
    mine = evaluate(local, env, chat, num_problems=10, max_new_tokens=6, batch_size=4)
    theirs = evaluate(remote, env, chat, num_problems=10, max_new_tokens=6, batch_size=4, num_samples=2)
    assert theirs.examples == mine.examples and theirs.accuracy == mine.accuracy
    assert theirs.pass_at_k is not None and theirs.avg_at_k is not None
