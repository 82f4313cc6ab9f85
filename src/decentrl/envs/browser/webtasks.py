"""Web tasks generated from seeds, in the style of MiniWoB++ (Shi et al. 2017; Liu et al. 2018).

A task is a small web page described by a `PageSpec`: pages of elements (buttons, text boxes, drop-
down lists, links), each with an id, and a goal: the button whose click ends the episode and the
values the fields must hold at that moment. The page itself (`page.html`) renders the spec in the
browser, handles the clicks and keys, and judges the goal from its own state. Kinds:

| kind | instruction | steps |
|---|---|---|
| `click` | `click "plum"` (3-4 buttons; any click ends the episode) | 1 |
| `form` | `type "kibo" in city, submit` (two text boxes and a submit button) | 2 |
| `select` | `select "fig" in fruit, submit` (a drop-down list of 3 and a submit button) | 2 |
| `navigate` | `open "news", click "more"` (3 links, each to a page of its own buttons) | 2 |
| `scroll` | `click "plum"` (10 buttons; only 6 fit the window) | 1-2 |

`initial_observation` renders the first page as the browser's observation of it does
(`page.html`'s `observe`): the layout is fixed (36 px rows in a 480 x 216 window), so the prompt is
made without a browser, and an env server checks at each reset that the browser sees the same.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from typing import Literal

from decentrl.envs.toolcalls import ToolCall

Kind = Literal["click", "form", "select", "navigate", "scroll"]
KINDS: tuple[Kind, ...] = ("click", "form", "select", "navigate", "scroll")
ROW_PIXELS = 36
VISIBLE_ROWS = 6
WINDOW = (480, ROW_PIXELS * VISIBLE_ROWS)
"""The tab's size in CSS pixels: exactly `VISIBLE_ROWS` rows fit (page.html sets the row height)."""

WORDS = [
    "pear",
    "plum",
    "fig",
    "lime",
    "kiwi",
    "date",
    "apple",
    "mango",
    "grape",
    "melon",
    "peach",
    "olive",
    "berry",
    "lemon",
    "red",
    "blue",
    "green",
    "pink",
    "gold",
    "gray",
    "black",
    "white",
    "brown",
    "cyan",
    "cat",
    "dog",
    "owl",
    "fox",
    "bee",
    "cow",
    "hen",
    "elk",
    "yak",
    "ant",
    "sun",
    "moon",
    "star",
    "rain",
    "snow",
    "wind",
    "leaf",
    "rock",
    "sand",
    "wave",
]
FIELDS = ("name", "city", "pet", "code", "color", "town", "food", "song")
VALUES = ("kibo", "tamu", "rovi", "lena", "pako", "miru", "sato", "vane", "dorn", "felu", "gima", "huro")
SECTIONS = ("home", "news", "shop", "help", "blog", "docs", "mail", "maps")


@dataclass(frozen=True)
class Element:
    id: int
    role: Literal["button", "textbox", "combobox", "link"]
    label: str
    options: tuple[str, ...] = ()
    """A combobox's choices (its first one is selected at the start)."""
    goto: int | None = None
    """A link: the page it opens."""
    ends: bool = False
    """A button whose click ends the episode (the page then judges its goal)."""


@dataclass(frozen=True)
class PageSpec:
    kind: Kind
    instruction: str
    pages: tuple[tuple[Element, ...], ...]
    goal_click: int
    """The button whose click succeeds (with `goal_values` held)."""
    goal_values: dict[int, str] = field(default_factory=dict)
    """Field id -> the value it must hold when the goal button is clicked."""

    def to_json(self) -> str:
        """What page.html's `decentrl.load` takes."""
        data = asdict(self)
        data["goal_values"] = {str(k): v for k, v in self.goal_values.items()}
        return json.dumps(data, separators=(",", ":"), sort_keys=True)

    def element(self, element_id: int) -> Element:
        return next(e for page in self.pages for e in page if e.id == element_id)


def _click(rng: random.Random) -> PageSpec:
    labels = rng.sample(WORDS, rng.randint(3, 4))
    buttons = tuple(Element(i + 1, "button", label, ends=True) for i, label in enumerate(labels))
    target = rng.choice(buttons)
    return PageSpec("click", f'click "{target.label}"', (buttons,), target.id)


def _scroll(rng: random.Random) -> PageSpec:
    labels = rng.sample(WORDS, VISIBLE_ROWS + 4)
    buttons = tuple(Element(i + 1, "button", label, ends=True) for i, label in enumerate(labels))
    target = rng.choice(buttons)
    return PageSpec("scroll", f'click "{target.label}"', (buttons,), target.id)


def _form(rng: random.Random) -> PageSpec:
    names = rng.sample(FIELDS, 2)
    boxes = tuple(Element(i + 1, "textbox", name) for i, name in enumerate(names))
    submit = Element(3, "button", "submit", ends=True)
    target, value = rng.choice(boxes), rng.choice(VALUES)
    instruction = f'type "{value}" in {target.label}, submit'
    return PageSpec("form", instruction, ((*boxes, submit),), submit.id, {target.id: value})


def _select(rng: random.Random) -> PageSpec:
    name, options = rng.choice(FIELDS), tuple(rng.sample(WORDS, 3))
    box, submit = Element(1, "combobox", name, options), Element(2, "button", "submit", ends=True)
    value = rng.choice(options[1:])  # not the preselected first option: the select must happen
    instruction = f'select "{value}" in {name}, submit'
    return PageSpec("select", instruction, ((box, submit),), submit.id, {box.id: value})


def _navigate(rng: random.Random) -> PageSpec:
    sections = rng.sample(SECTIONS, 3)
    links = tuple(Element(i + 1, "link", name, goto=i + 1) for i, name in enumerate(sections))
    labels = rng.sample(WORDS, 3 * len(links))
    next_id = len(links) + 1
    pages: list[tuple[Element, ...]] = [links]
    for index in range(len(links)):
        names = labels[3 * index : 3 * index + 3]
        pages.append(tuple(Element(next_id + k, "button", label, ends=True) for k, label in enumerate(names)))
        next_id += len(names)
    page = rng.randrange(len(links))
    target = rng.choice(pages[page + 1])
    instruction = f'open "{links[page].label}", click "{target.label}"'
    return PageSpec("navigate", instruction, tuple(pages), target.id)


GENERATORS = {"click": _click, "form": _form, "select": _select, "navigate": _navigate, "scroll": _scroll}


def generate(kind: Kind, rng: random.Random) -> PageSpec:
    return GENERATORS[kind](rng)


def describe(element: Element, value: str | None = None) -> str:
    """One line of the observation (page.html's `line` writes the same from the DOM)."""
    text = f"[{element.id}] {element.role} {json.dumps(element.label)}"
    if element.role == "textbox":
        text += f": {json.dumps(value or '')}"
    elif element.role == "combobox":
        text += f": {json.dumps(value or element.options[0])} of {'|'.join(element.options)}"
    return text


def initial_observation(spec: PageSpec) -> str:
    """The first page as the browser observes it right after loading: the rows that fit the
    window, and how many more are below."""
    rows = spec.pages[0]
    lines = [describe(element) for element in rows[:VISIBLE_ROWS]]
    if len(rows) > VISIBLE_ROWS:
        lines.append(f"({len(rows) - VISIBLE_ROWS} more below)")
    return "\n".join(lines)


def solution(spec: PageSpec) -> list[ToolCall]:
    """A perfect teacher's actions for the task."""
    verbs = {"textbox": "type", "combobox": "select"}
    calls = [ToolCall(verbs[spec.element(i).role], [i, v]) for i, v in spec.goal_values.items()]
    if spec.kind == "navigate":
        link = next(e for e in spec.pages[0] if spec.element(spec.goal_click) in spec.pages[e.goto or 0])
        calls.append(ToolCall("click", [link.id]))
    if spec.kind == "scroll" and spec.goal_click > VISIBLE_ROWS:
        calls.append(ToolCall("scroll", ["down"]))
    return [*calls, ToolCall("click", [spec.goal_click])]


def visible_ids(spec: PageSpec, page: int = 0) -> list[int]:
    return [e.id for e in spec.pages[page][:VISIBLE_ROWS]]
