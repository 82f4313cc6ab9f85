"""The `browser` environment in a real headless Chromium (Debian's, over the DevTools pipe).

The prompt's view of each task is made without a browser; these check that the browser shows the
same, that the scripted solution of every kind succeeds and a wrong move fails, that a live
session and the replayed `respond`/`reward` agree move for move, and that the tools are bounded.
"""

from __future__ import annotations

import random
import shutil

import pytest

from decentrl.envs import load_environment
from decentrl.envs.base import TeacherHabits
from decentrl.envs.browser.chromium import BrowserGone, Chromium
from decentrl.envs.browser.webtasks import KINDS, VISIBLE_ROWS, initial_observation, solution
from decentrl.envs.live import open_session

pytestmark = pytest.mark.skipif(
    shutil.which("chromium") is None, reason="needs Chromium: make browser-tools (apt-get install chromium)"
)


@pytest.fixture(scope="module")
def env():
    environment = load_environment("browser", kinds=list(KINDS))
    yield environment
    environment.close()


def play(env, problem, actions: list[str]) -> tuple[list[dict], float, float]:
    """Messages of the live session after `actions`, its reward, and the replayed reward."""
    session = open_session(env, problem)
    messages = list(problem.prompt)
    try:
        for action in actions:
            messages.append({"role": "assistant", "content": action})
            reply = session.step(action)
            assert reply == env.respond(problem, messages)  # the replay answers move for move as the tab
            if reply is None:
                break
            messages += reply
        return messages, session.reward(), env.reward(problem, messages)
    finally:
        session.close()


def test_the_browser_shows_what_the_prompt_says_for_every_kind(env):
    for seed in range(25):
        problem = env.problem(seed, "train")
        session = env.session(problem)  # raises ObservationMismatch otherwise
        session.close()
        assert problem.text.endswith(initial_observation(problem.info["spec"]))


def test_the_solution_of_every_kind_succeeds_and_a_wrong_move_fails(env):
    seen = set()
    for seed in range(30):
        problem = env.problem(seed, "eval")
        spec = problem.info["spec"]
        seen.add(spec.kind)
        perfect = [env.format.render(call) for call in solution(spec)]
        _, live, replayed = play(env, problem, perfect)
        assert live == replayed == 1.0, (spec.instruction, perfect)
        wrong = env.demonstration(problem, random.Random(seed), TeacherHabits())  # perfect too
        assert wrong == perfect
    assert seen == set(KINDS)
    env.teacher_misclick = 1.0
    try:
        for seed in range(15):
            problem = env.problem(seed, "train")
            slipped = env.demonstration(problem, random.Random(seed), TeacherHabits())
            messages, live, replayed = play(env, problem, slipped)
            assert live == replayed == 0.0, (problem.text, slipped, messages)
    finally:
        env.teacher_misclick = 0.0


def test_an_element_off_the_screen_cannot_be_clicked_until_scrolled_to(env):
    problem = next(
        p
        for p in (env.problem(seed, "train") for seed in range(500))
        if p.info["spec"].kind == "scroll" and p.info["spec"].goal_click > VISIBLE_ROWS
    )
    target = problem.info["spec"].goal_click
    messages, live, _ = play(env, problem, [f"click({target})", 'scroll("down")', f"click({target})"])
    assert messages[2]["content"] == f"error: element {target} is not on the screen"
    assert f"[{target}] button" in messages[4]["content"] and "more above" in messages[4]["content"]
    assert live == 1.0


def test_tool_calls_are_checked_and_bounded(env):
    problem = next(p for p in (env.problem(s, "train") for s in range(200)) if p.info["spec"].kind == "form")
    messages, _, _ = play(
        env,
        problem,
        ['type(1, "' + "x" * 41 + '")', "type(3, 'kibo')", "click('one')", "fly(1)"],
    )
    errors = [m["content"] for m in messages if m["role"] == "tool"]
    assert errors[0] == "error: type: text of 41 characters; at most 40"
    assert errors[1] == "error: element 3 is a button, not a textbox"
    assert errors[2].startswith("error: click: argument 'id' must be")
    assert errors[3].startswith("error: unknown tool 'fly'; available: click, done, scroll, select, type")


def test_typing_shows_in_the_next_view_and_a_text_that_is_no_call_ends_the_episode(env):
    problem = next(p for p in (env.problem(s, "train") for s in range(200)) if p.info["spec"].kind == "form")
    messages, live, _ = play(env, problem, ["type(2, 'tamu')", "I am done"])
    assert "[2] textbox" in messages[2]["content"] and '"tamu"' in messages[2]["content"]
    assert messages[-1] == {"role": "assistant", "content": "I am done"} and live == 0.0


def test_a_killed_browser_is_seen_at_the_next_command():
    browser = Chromium()
    try:
        tab = browser.new_tab(200, 100)
        assert browser.evaluate(tab, "1 + 1") == 2
        import os
        import signal

        os.killpg(browser.pid, signal.SIGKILL)
        with pytest.raises(BrowserGone):
            browser.evaluate(tab, "1 + 1")
    finally:
        browser.close()
