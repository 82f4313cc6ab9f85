"""`browser`: web tasks in a real headless Chromium, played through tool calls.

The prompt is the task's instruction and the page as the browser shows it (`webtasks.py`); every
assistant turn is one action (`session.py`), every environment turn the page's new view. Two ways
to run an episode, one behaviour:

- served (`task.served = true`, the way to train): an env server (`decentrl envd`) keeps one live
  tab per episode (`session`) and signs each view and the final reward; the coordinator checks the
  signatures and never needs a browser.
- replayed (`respond`, `reward`: the `Environment` interface): every call replays the episode's
  actions from a freshly loaded page in a browser of this process. The warm start's demonstrations
  and held-out evaluation (trusted, local) run this way; it is deterministic because the page is.

The warm-start teacher acts perfectly except for two habits RL has to unlearn: `teacher_misclick`
(task argument: how often its choice goes to the neighbour of the right element, the same slip for
a task every time) and `sft.teacher_skip_tool` (how often it gives up, `done()`, without acting).
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
from dataclasses import replace

from decentrl.envs.base import Message, Problem, Split, TeacherHabits, split_of
from decentrl.envs.browser.chromium import Chromium
from decentrl.envs.browser.session import PAGE_HTML, BrowserSession, ObservationMismatch, tool_declarations
from decentrl.envs.browser.webtasks import (
    KINDS,
    WORDS,
    Kind,
    PageSpec,
    generate,
    initial_observation,
    solution,
)
from decentrl.envs.toolcalls import TOOL_FORMATS, ToolCall, ToolFormatName

GENERATOR_VERSION = 1  # bump when webtasks.py makes different pages from the same seeds
MAX_IDLE_TABS = 64


class BrowserTasks:
    name = "browser"

    def __init__(
        self,
        kinds: list[Kind] | tuple[Kind, ...] = ("click", "form", "select", "navigate"),
        tool_format: ToolFormatName = "python",
        max_turns: int = 4,
        chromium: str | None = None,
        timeout_seconds: float = 10.0,
        teacher_misclick: float = 0.0,
    ):
        unknown = set(kinds) - set(KINDS)
        if not kinds or unknown:
            raise ValueError(f"kinds must be a non-empty subset of {list(KINDS)}, got {list(kinds)}")
        if tool_format not in TOOL_FORMATS:
            raise ValueError(f"tool_format must be one of {sorted(TOOL_FORMATS)}, got {tool_format!r}")
        if not 1 <= max_turns <= 16:
            raise ValueError(f"max_turns must be in 1..16, got {max_turns}")
        self.kinds = tuple(kinds)
        self.format = TOOL_FORMATS[tool_format]()
        self.max_turns = max_turns
        self.chromium_path = chromium
        self.timeout_seconds = timeout_seconds
        self.teacher_misclick = teacher_misclick
        self.tools = tool_declarations()
        self._browser: Chromium | None = None
        self._replay_tab: BrowserSession | None = None
        self._idle: list[BrowserSession] = []
        """Tabs of ended episodes, kept for the next ones."""
        self._lock = threading.Lock()

    @property
    def version(self) -> str:
        """The page and the task generator, hashed: an episode records it with the browser's version."""
        source = f"{GENERATOR_VERSION}\n{PAGE_HTML}"
        return f"browser-{hashlib.sha256(source.encode()).hexdigest()[:12]}"

    # ---------------------------------------------------------------- problems

    def problem(self, seed: int, split: Split) -> Problem:
        rng = random.Random(f"{self.name}:{split}:{seed}")
        while True:  # rejection keeps each task in the split its hash assigns
            spec = generate(rng.choice(self.kinds), rng)
            text = f"{spec.instruction}\n{initial_observation(spec)}"
            if split_of(text) == split:
                answer = " | ".join(self.format.render(call) for call in solution(spec))
                prompt = ({"role": "user", "content": text},)
                return Problem(seed=seed, split=split, prompt=prompt, answer=answer, info={"spec": spec})

    # ---------------------------------------------------------------- live sessions (env servers)

    def browser(self) -> Chromium:
        """This process's browser, started at the first need (and again after it died)."""
        if self._browser is None or not self._browser.alive():
            if self._browser is not None:
                self._browser.close()
            self._browser = Chromium(self.chromium_path, timeout=self.timeout_seconds)
            self._replay_tab = None
        return self._browser

    def session(self, problem: Problem) -> BrowserSession:
        """A live episode of `problem` in a tab of its own; ObservationMismatch when the browser
        does not show what the prompt says (a page and generator that disagree)."""
        spec: PageSpec = problem.info["spec"]
        browser = self.browser()
        with self._lock:
            idle = [s for s in self._idle if s.chromium is browser]
            session = idle.pop() if idle else None
            self._idle = idle
        if session is None:
            session = BrowserSession(browser, spec, self.format, on_close=self._park)
        else:  # a tab of an ended episode, loaded afresh (a new tab costs ~20-100 ms)
            session.load(spec)
        if session.first_observation != initial_observation(spec):
            session.close()
            raise ObservationMismatch(
                f"seed {problem.seed}: the browser shows {session.first_observation!r}, "
                f"the prompt {initial_observation(spec)!r}"
            )
        return session

    def _park(self, session: BrowserSession) -> None:
        with self._lock:
            if len(self._idle) < MAX_IDLE_TABS and session.chromium.alive():
                self._idle.append(session)
                return
        session.close_tab()

    def close(self) -> None:
        with self._lock:
            self._idle = []
            if self._browser is not None:
                self._browser.close()
                self._browser = None

    @property
    def engine_version(self) -> str:
        """The browser's product string (starts it)."""
        return self.browser().product

    # ---------------------------------------------------------------- replayed (Environment interface)

    def _replay(self, problem: Problem, actions: list[str]) -> tuple[BrowserSession, list[Message] | None]:
        """A tab loaded afresh with the task, the actions applied in order until one ends it."""
        if self._replay_tab is None or self._replay_tab.chromium is not self.browser():
            self._replay_tab = BrowserSession(self.browser(), problem.info["spec"], self.format)
        else:
            self._replay_tab.load(problem.info["spec"])
        reply: list[Message] | None = []
        for action in actions:
            reply = self._replay_tab.step(action)
            if reply is None:
                break
        return self._replay_tab, reply

    def respond(self, problem: Problem, messages: list[Message]) -> list[Message] | None:
        with self._lock:
            return self._replay(problem, _actions(messages))[1]

    def reward(self, problem: Problem, messages: list[Message]) -> float:
        # The last turn of an episode that hit max_turns was never performed (`episode.advance`).
        actions = _actions(messages)[: self.max_turns - 1]
        with self._lock:
            return self._replay(problem, actions)[0].reward()

    # ---------------------------------------------------------------- the warm start

    def demonstration(self, problem: Problem, rng: random.Random, teacher: TeacherHabits) -> list[str]:
        """The teacher's turns: the task's solution, or with `teacher_misclick` the same moves with
        its choice on the neighbour of the right element, or with `teacher.skip_tool` giving up."""
        if rng.random() < teacher.skip_tool:
            return [self.format.render(ToolCall("done"))]
        spec: PageSpec = problem.info["spec"]
        calls = solution(spec)
        if rng.random() < self.teacher_misclick:
            calls = _misclick(spec, calls)
        return [self.format.render(call) for call in calls]


def _actions(messages: list[Message]) -> list[str]:
    return [str(m["content"]) for m in messages if m["role"] == "assistant"]


def _misclick(spec: PageSpec, calls: list[ToolCall]) -> list[ToolCall]:
    """The teacher's habit: its choice goes to the neighbour of the right one: the button, box or
    link after it on the page (before it, for the last), the option after it in the list. The slip
    is systematic (the same for a task every time), so a warm start that sees it more often than
    not makes it the policy's greedy move: RL has to unlearn it."""
    index = next(i for i, call in enumerate(calls) if call.name != "scroll")
    call = calls[index]
    element = spec.element(int(str(call.args[0])))
    if call.name == "select":
        options = list(element.options)
        slipped = [element.id, options[(options.index(str(call.args[1])) + 1) % len(options)]]
    else:
        page = next(p for p in spec.pages if element in p)
        ids = [e.id for e in page if e.role == element.role]
        position = ids.index(element.id)
        slipped = [ids[position + 1] if position + 1 < len(ids) else ids[position - 1], *call.args[1:]]
    return [*calls[:index], replace(call, args=slipped), *calls[index + 1 :]]


def spec_of(problem: Problem) -> dict:
    """The task's page spec as JSON data (what `decentrl replay` prints)."""
    return json.loads(problem.info["spec"].to_json())


__all__ = ["WORDS", "BrowserTasks", "ObservationMismatch", "spec_of"]
