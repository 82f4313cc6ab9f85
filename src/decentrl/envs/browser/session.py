"""One episode of a web task in a live browser tab: the model's tool calls become real clicks and keys.

A session is a tab of a shared `Chromium`, loaded with `page.html` and the task's spec. `step`
takes the text of one assistant turn, parses it as a tool call (`click(id)`, `type(id, text)`,
`select(id, option)`, `scroll(direction)`, `done()`) and performs it as a user would: a click is
a mouse press and release at the element's centre (hit-tested by the browser, so an element off
the screen cannot be clicked), typing focuses the field with a click and commits the text as an
input method does. The answer is the page's new accessibility view, an `error: ...` line for a
call the page refuses (the model can learn from it), or None when the episode is over: the page
judged its goal (a button that ends the task was clicked), `done()` was called, or the turn was
no call at all. `reward` reads the outcome from the page's own state.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

from decentrl.envs.base import Message
from decentrl.envs.browser.chromium import Chromium
from decentrl.envs.browser.webtasks import WINDOW, PageSpec
from decentrl.envs.toolcalls import ToolCallFormat
from decentrl.envs.tools import ToolError, call_tool, tool_schema

PAGE_HTML = (Path(__file__).with_name("page.html")).read_text()
MAX_TEXT = 40
"""Longest text `type` or `select` accepts: actions are bounded in size as in number."""
ACTIONS = ("click", "type", "select", "scroll", "done")


class ObservationMismatch(RuntimeError):
    """The browser's view of a freshly loaded task differs from the prompt the task was leased with."""


class BrowserSession:
    def __init__(
        self,
        chromium: Chromium,
        spec: PageSpec,
        tool_format: ToolCallFormat,
        on_close: Callable[[BrowserSession], None] | None = None,
    ):
        self.chromium = chromium
        self.format = tool_format
        self.on_close = on_close
        """Takes the tab back for a later episode (`BrowserTasks`); None: `close` closes the tab."""
        self.tab = chromium.new_tab(*WINDOW)
        chromium.load_html(self.tab, PAGE_HTML)
        self.load(spec)

    def load(self, spec: PageSpec) -> None:
        """Start the episode of `spec` in this tab: page.html's `load` resets every bit of its state."""
        self.spec = spec
        self.first_observation = str(self._call("load", spec.to_json()))
        self.steps = 0

    def _call(self, function: str, *args: object) -> object:
        import json

        arguments = ", ".join(json.dumps(a) for a in args)
        return self.chromium.evaluate(self.tab, f"window.decentrl.{function}({arguments})")

    # ---------------------------------------------------------------- the episode

    def step(self, action: str) -> list[Message] | None:
        """Perform one assistant turn; the environment's answer, or None once the episode is over."""
        self.steps += 1
        try:
            call = self.format.parse(action)
            if call is None:  # a turn that is no call ends the episode, as a final answer would
                return None
            call_tool(self.actions(), call.name, call.args, call.kwargs)
        except ToolError as exc:
            return [{"role": "tool", "content": f"error: {exc}"}]
        if call.name == "done" or self.result()["ended"]:
            return None
        return [{"role": "tool", "content": self.observe()}]

    def observe(self) -> str:
        return str(self._call("observe"))

    def result(self) -> dict:
        result = self._call("result")
        assert isinstance(result, dict), f"page.html's result() answered {result!r}"
        return result

    def reward(self, final_action: str | None = None) -> float:
        """1 when the page judged its goal reached, else 0 (a turn not performed changes no page)."""
        return 1.0 if self.result()["success"] else 0.0

    def screenshot(self) -> bytes:
        return self.chromium.screenshot(self.tab)

    def close(self) -> None:
        if self.on_close is not None:
            self.on_close(self)
        else:
            self.close_tab()

    def close_tab(self) -> None:
        self.chromium.close_tab(self.tab)

    # ---------------------------------------------------------------- the tools

    def actions(self) -> dict:
        return {name: getattr(self, name) for name in ACTIONS}

    def _centre(self, id: int, role: str | None = None) -> tuple[float, float]:
        centre = self._call("centre", id)
        if centre is None:
            raise ToolError(f"element {id} is not on the screen")
        assert isinstance(centre, dict)
        if role is not None and centre["role"] != role:
            raise ToolError(f"element {id} is a {centre['role']}, not a {role}")
        return centre["x"], centre["y"]

    def click(self, id: int) -> None:
        """Click an element (a button or a link) on the screen.

        Args:
            id: the element's number in the page's view.
        """
        self.chromium.click(self.tab, *self._centre(id))

    def type(self, id: int, text: str) -> None:
        """Type text into a text box, replacing what it held.

        Args:
            id: the text box's number in the page's view.
            text: what to type.
        """
        if len(text) > MAX_TEXT:
            raise ToolError(f"type: text of {len(text)} characters; at most {MAX_TEXT}")
        self.chromium.click(self.tab, *self._centre(id, "textbox"))
        self._call("selectAll", id)
        self.chromium.insert_text(self.tab, text)

    def select(self, id: int, option: str) -> None:
        """Choose an option of a drop-down list.

        Args:
            id: the list's number in the page's view.
            option: the option to choose, as the view writes it.
        """
        self._centre(id, "combobox")
        if len(option) > MAX_TEXT or not self._call("choose", id, option):
            raise ToolError(f"select: element {id} has no option {option!r}")

    def scroll(self, direction: Literal["up", "down"]) -> None:
        """Scroll the page by one window.

        Args:
            direction: "up" or "down".
        """
        self._call("scroll", -1 if direction == "up" else 1)

    def done(self) -> None:
        """End the episode."""


def tool_declarations() -> list[dict]:
    """The JSON-Schema declarations of the actions, for the chat template."""
    unbound = BrowserSession.__new__(BrowserSession)  # the signatures and docstrings, no browser
    return [tool_schema(getattr(unbound, name)) for name in ACTIONS]
