"""The environment interface: tool schemas, tool calls, chat formatting, episodes and their replay,
`load_environment` (built-ins and entry points), the gym adapter, reasoning-gym and code tasks."""

from __future__ import annotations

import importlib
import random
import sys
import tomllib
from pathlib import Path
from typing import Literal

import pytest

from decentrl.engines.base import Completion
from decentrl.envs import UnknownEnvironment, load_environment
from decentrl.envs.base import TeacherHabits
from decentrl.envs.chat import ChatFormat
from decentrl.envs.episode import ReplayMismatch, replay, run_episodes, start
from decentrl.envs.gym import GymEnvironment
from decentrl.envs.registry import BUILTINS
from decentrl.envs.toolcalls import HermesFormat, PythonFormat, ToolCall
from decentrl.envs.tools import ToolError, call_tool, tool_schema
from decentrl.model.tokenizer import build_char_tokenizer
from decentrl.protocol import SamplingParams, Segment


def convert(amount: float, unit: Literal["km", "mi"], digits: int = 2, tags: list[str] | None = None) -> str:
    """Convert a distance.

    Args:
        amount: the distance to convert.
        unit: the unit of `amount`.
    """
    return f"{amount}{unit}"


def test_tool_schema_from_signature_and_docstring() -> None:
    assert tool_schema(convert) == {
        "type": "function",
        "function": {
            "name": "convert",
            "description": "Convert a distance.",
            "parameters": {
                "type": "object",
                "properties": {
                    "amount": {"type": "number", "description": "the distance to convert."},
                    "unit": {"enum": ["km", "mi"], "description": "the unit of `amount`."},
                    "digits": {"type": "integer"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["amount", "unit"],
            },
        },
    }


def test_call_tool_checks_arguments_against_the_signature() -> None:
    tools = {"convert": convert}
    assert call_tool(tools, "convert", [3], {"unit": "km"}) == "3km"
    for name, args, kwargs, message in [
        ("nope", [], {}, "unknown tool"),
        ("convert", ["3"], {"unit": "km"}, "'amount' must be"),
        ("convert", [3], {"unit": "ly"}, "'unit' must be"),
        ("convert", [3], {}, "missing a required argument"),
    ]:
        with pytest.raises(ToolError, match=message):
            call_tool(tools, name, args, kwargs)


def test_tool_call_formats_parse_literals_only() -> None:
    python, hermes = PythonFormat(), HermesFormat()
    assert python.parse("lookup('kibo')") == ToolCall("lookup", ["kibo"], {})
    assert python.parse("4821") is None and python.parse("the answer is f(x)") is None
    with pytest.raises(ToolError):
        python.parse("lookup(__import__('os').system('true'))")  # never evaluated
    call = ToolCall("lookup", [], {"name": "kibo"})
    assert hermes.parse("ok " + hermes.render(call)) == call
    assert python.parse(python.render(call)) == call
    with pytest.raises(ToolError):
        hermes.parse("<tool_call>{not json}</tool_call>")


@pytest.fixture(scope="module")
def chat() -> ChatFormat:
    return ChatFormat.from_hf(build_char_tokenizer())


def test_env_turn_is_the_template_text_after_the_model_turn(chat: ChatFormat) -> None:
    ids = chat.env_ids([{"role": "tool", "content": "4532"}], ended_with=chat.eos_token_ids[0])
    assert chat.tokenizer.decode(ids, skip_special_tokens=False) == "\ntool: 4532\nassistant: "
    prompt = chat.prompt_ids(({"role": "user", "content": "code of kibo?"},))
    assert chat.tokenizer.decode(prompt) == "user: code of kibo?\nassistant: "
    assert chat.prompt_ids("12+34=") == chat.tokenizer.encode("12+34=").ids  # raw prompts: no template


class ScriptedEngine:
    """Answers each generate call with the next scripted turn (the model is not under test here)."""

    def __init__(self, chat: ChatFormat, turns: list[str]):
        self.chat, self.turns, self.prompts, self.samplings = chat, list(turns), [], []

    def generate(self, prompts, sampling, seed=None):
        self.prompts.append(prompts)
        self.samplings.append(sampling)
        ids = self.chat.tokenizer.encode(self.turns.pop(0), add_special_tokens=False).ids + [1]
        return [Completion(ids, [-0.5] * len(ids), [0] * len(ids), "stop") for _ in prompts]


def play(chat: ChatFormat, turns: list[str], max_new_tokens: int = 40, max_context: int | None = None):
    env = load_environment("tool_use")
    problem = env.problem(7, "train")
    turns = [t.replace("NAME", problem.info["name"]).replace("CODE", problem.answer) for t in turns]
    engine = ScriptedEngine(chat, turns)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, max_context=max_context)
    [episode] = run_episodes(engine, env, chat, [start(env, chat, problem)], sampling, seed=0)
    return env, problem, episode, engine


def test_tool_use_episode_alternates_model_and_env_tokens_and_replays(chat: ChatFormat) -> None:
    env, problem, episode, engine = play(chat, ["lookup('NAME')", "CODE"])
    assert [s.source for s in episode.segments] == ["model", "env", "model"]
    assert episode.stop == "final_answer" and env.reward(problem, episode.messages) == 1.0
    # turn 2 continues from the exact ids of turn 1 plus the env tokens: nothing re-tokenised
    assert (
        engine.prompts[1][0]
        == episode.prompt_ids + episode.segments[0].token_ids + episode.segments[1].token_ids
    )
    replayed = replay(env, chat, problem, episode.segments, budget=40)
    assert env.reward(problem, replayed.messages) == 1.0
    forged = [
        episode.segments[0],
        Segment(
            source="env",
            token_ids=chat.env_ids([{"role": "tool", "content": "0000"}], ended_with=chat.eos_token_ids[0]),
        ),
        episode.segments[2],
    ]
    with pytest.raises(ReplayMismatch, match="segments\\[1\\]"):
        replay(env, chat, problem, forged, budget=40)
    with pytest.raises(ReplayMismatch, match="ends before"):
        replay(env, chat, problem, episode.segments[:2], budget=40)


def test_tool_use_needs_a_tool_call_and_stops_on_budget_and_turns(chat: ChatFormat) -> None:
    env, problem, episode, _ = play(chat, ["CODE"])  # right code, no call: memorised or guessed
    assert episode.stop == "final_answer" and env.reward(problem, episode.messages) == 0.0
    env, problem, episode, _ = play(chat, ["lookup('NAME')"] * 3, max_new_tokens=60)
    assert episode.stop == "max_turns" and len(episode.segments) == 5
    env, problem, episode, _ = play(chat, ["lookup('NAME')", "CODE"], max_new_tokens=17)
    assert episode.stop == "max_tokens" and episode.finish_reason((1,)) == "length"
    assert episode.num_model_tokens == 17


def test_multi_turn_episodes_stay_inside_the_models_context(chat: ChatFormat) -> None:
    turns = ["lookup('NAME')", "CODE"]
    env, problem, full, _ = play(chat, turns)  # no context given: only the budget bounds it
    second = len(full.prompt_ids) + len(full.segments[0].token_ids) + len(full.segments[1].token_ids)
    assert len(full.segments[2].token_ids) > 3
    # room for 3 tokens after the tool's answer: the second turn is cut there, the episode ends
    _, _, cut, engine = play(chat, turns, max_context=second + 3)
    assert [s.source for s in cut.segments] == ["model", "env", "model"]
    assert len(cut.token_ids) == second + 3 and cut.stop == "max_tokens"
    assert engine.samplings[1].max_new_tokens == 3  # asked for no more than fits
    assert replay(env, chat, problem, cut.segments, budget=40, max_context=second + 3).stop == "max_tokens"
    longer = full.segments[2].model_copy(
        update={
            key: getattr(full.segments[2], key)[:4] for key in ("token_ids", "logprobs", "policy_versions")
        }
    )
    with pytest.raises(ReplayMismatch, match="segments\\[2\\] has 4 tokens where the model's context"):
        replay(env, chat, problem, [*cut.segments[:2], longer], budget=40, max_context=second + 3)
    # a tool answer after which not one model token fits ends the episode instead of being appended
    _, _, ended, engine = play(chat, turns, max_context=second)
    assert ended.stop == "context" and [s.source for s in ended.segments] == ["model"]
    assert len(engine.prompts) == 1
    assert replay(env, chat, problem, ended.segments, budget=40, max_context=second).stop == "context"
    with pytest.raises(ReplayMismatch, match="ended \\(context\\) after segments\\[0\\]"):
        replay(env, chat, problem, full.segments, budget=40, max_context=second)


def test_tool_use_splits_are_disjoint_and_teacher_can_skip_the_tool() -> None:
    env = load_environment("tool_use")
    train = {env.problem(s, "train").info["name"] for s in range(2000)}
    held_out = {env.problem(s, "eval").info["name"] for s in range(500)}
    assert train.isdisjoint(held_out) and len(held_out) > 100
    problem = env.problem(0, "train")
    assert env.demonstration(problem, random.Random(0), TeacherHabits(skip_tool=1.0)) == ["?"]
    assert env.demonstration(problem, random.Random(0), TeacherHabits())[1] == problem.answer


def test_unknown_environment_names_the_built_ins() -> None:
    with pytest.raises(UnknownEnvironment, match="tool_use") as error:
        load_environment("sudoku")
    assert "decentrl.environments" in str(error.value)
    with pytest.raises(ValueError, match="task.args"):
        load_environment("arithmetic", num_digit=2)


def test_built_ins_are_the_packages_entry_points_and_each_imports() -> None:
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"]["decentrl.environments"] == BUILTINS
    for target in BUILTINS.values():
        module, attribute = target.split(":")
        assert callable(getattr(importlib.import_module(module), attribute)), target


def test_third_party_environment_through_an_entry_point(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_env.py").write_text(
        "from decentrl.envs.arithmetic import Arithmetic\n"
        "def load_environment(**kwargs):\n    env = Arithmetic(**kwargs)\n    env.name = 'mine'\n    return env\n"
    )
    info = tmp_path / "my_env-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-env\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[decentrl.environments]\nmine = my_env:load_environment\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = load_environment("mine", num_digits=1, operations="*")
    assert env.name == "mine" and "*" in env.problem(0, "train").prompt
    monkeypatch.delitem(sys.modules, "my_env", raising=False)


class GuessNumber:
    """A gym-style text env: guess a number in 0..9 from higher/lower hints."""

    def reset(self, seed: int):
        self.target, self.guesses = seed % 10, 0
        return "guess 0-9", {}

    def step(self, action: str):
        self.guesses += 1
        guess = int(action) if action.strip().isdigit() else -1
        if guess == self.target:
            return "right", 1.0, True, False, {}
        return ("higher" if guess < self.target else "lower"), 0.0, False, self.guesses >= 3, {}


def test_gym_adapter_replays_actions_from_reset() -> None:
    env = GymEnvironment(GuessNumber, name="guess", max_turns=3)
    problem = env.problem(7, "train")
    messages = [*problem.prompt, {"role": "assistant", "content": "5"}]
    assert env.respond(problem, messages) == [{"role": "user", "content": "higher"}]
    messages += [{"role": "user", "content": "higher"}, {"role": "assistant", "content": "7"}]
    assert env.respond(problem, messages) is None and env.reward(problem, messages) == 1.0
    assert env.reward(problem, messages[:2]) == 0.0


def test_reasoning_gym_exposes_20_tasks_with_exact_scoring() -> None:
    pytest.importorskip("reasoning_gym")
    from decentrl.envs.reasoning_gym import TASKS

    assert len(TASKS) >= 20
    for task in TASKS:
        env = load_environment("reasoning_gym", task=task)
        for seed in range(3):
            problem = env.problem(seed, "train")
            assert problem == env.problem(seed, "train") or problem.text == env.problem(seed, "train").text
            assert env.score(problem, f" {problem.answer}\n") == 1.0, task
            assert env.score(problem, f"{problem.answer} 0") == 0.0, task  # no credit for padding
            assert env.score(problem, f"answer: {problem.answer}") == 0.0, task
    arithmetic = load_environment("reasoning_gym", task="basic_arithmetic")
    train = {arithmetic.problem(s, "train").text for s in range(300)}
    assert train.isdisjoint({arithmetic.problem(s, "eval").text for s in range(100)})


def test_code_task_scores_hidden_tests_in_the_sandbox() -> None:
    env = load_environment("code")
    problem = env.problem(3, "train")
    assert "assert" not in problem.text and problem.info["tests"].count("assert") == 5
    try:
        assert env.score(problem, f"```python\n{problem.answer}\n```") == 1.0
    except RuntimeError as exc:  # SandboxUnavailable: no bubblewrap on this machine
        pytest.skip(str(exc))
    assert env.score(problem, "def f(*args):\n    return None") == 0.0
    assert env.score(problem, "import os\nos._exit(0)") == 0.0
