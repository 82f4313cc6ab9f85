"""Verifiable math: an answer's single `\\boxed{}` against the gold value, with math-verify.

math-verify (HuggingFace, Apache-2.0) decides symbolic equivalence (`1/2` = `0.5`, `2\\sqrt2` =
`\\sqrt8`, `10\\%` = `0.1`), but graded naively it rewards hacks (measured, see docs/rewards.md):
without a box it takes the *last number*, so "Candidates: 1, 2, 3" is right whenever 3 is; it
takes the last of several boxes; plain-text equations collapse to their right-hand side, so any
two `... = 0` equations match; and a power tower like `9^{9^{9}}` burns the whole timeout. So an
answer earns 1 only when it is short, holds exactly one `\\boxed{}`, that box holds one value (or
`x = value`) with no nested exponent, and math-verify says it equals the gold answer.

`Grade.reward` is the math reward wherever it is used: the `math` and `math500` environments, a
dataset's `math` reward and the rubric's `math_verify` term. math-verify times out with
`signal.alarm`, which only works on a main thread: call `grade` in the scoring pool's processes
(`rewards/pool.py`), which also kill a call that overruns.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from functools import lru_cache

MAX_ANSWER_CHARS = 4000
MAX_BOX_CHARS = 80
VERIFY_TIMEOUT_SECONDS = 3
_BOX = re.compile(r"\\boxed\s*\{")
_RELATION = re.compile(r"\\le|\\ge|\\neq|\\ne\b|\\lt|\\gt|[<>]|(?<![<>!])=")
_SINGLE_VARIABLE = re.compile(r"^\s*[A-Za-z]\s*$")
_NESTED_POWER = re.compile(r"\^\s*\{[^{}]*\^|\^\s*\d+\s*\^|\*\*[^*]*\*\*")
_LIST = re.compile(r"(?<!\\),|\\cup|\\cap|;")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")  # 1,000 is one number; 1,2,3 is a list


@dataclass(frozen=True)
class Grade:
    correct: bool
    reason: str
    """'ok', or why the answer earned nothing ('no box', 'several boxes', 'nested power', ...)."""

    @property
    def reward(self) -> float:
        """1 for a right answer, else 0."""
        return 1.0 if self.correct else 0.0


def boxed_contents(text: str) -> list[str]:
    """The contents of every `\\boxed{...}` in `text`, braces balanced."""
    contents = []
    for match in _BOX.finditer(text):
        depth, start = 1, match.end()
        for index in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[index], 0)
            if depth == 0:
                contents.append(text[start:index])
                break
    return contents


def _single_value(box: str) -> str | None:
    """The value of a box: `x = 3` gives `3`; a relation of anything else, or a list, gives None."""
    relations = list(_RELATION.finditer(box))
    if not relations:
        return box
    first = relations[0]
    if len(relations) > 1 or first.group() != "=" or not _SINGLE_VARIABLE.match(box[: first.start()]):
        return None
    return box[first.end() :]


def grade(answer: str, gold: str) -> Grade:
    """Grade one answer against the gold value (a LaTeX or plain number/expression)."""
    if len(answer) > MAX_ANSWER_CHARS:
        return Grade(False, "answer too long")
    boxes = boxed_contents(answer)
    if not boxes:
        return Grade(False, "no box")
    if len(boxes) > 1:
        return Grade(False, "several boxes")
    box = boxes[0].strip()
    if not box or len(box) > MAX_BOX_CHARS:
        return Grade(False, "empty or oversized box")
    if _NESTED_POWER.search(box):
        return Grade(False, "nested power")
    value = _single_value(box)
    if value is None or not value.strip():
        return Grade(False, "relation instead of a value")
    value = _THOUSANDS.sub("", value)
    if _LIST.search(value) and not _LIST.search(gold):
        return Grade(False, "several values")
    return Grade(_verify(gold, value), "ok")


@lru_cache(maxsize=1)
def _load_parsers() -> None:
    """math-verify imports sympy and builds its LaTeX parser on first use. On a loaded machine that
    alone outlasts VERIFY_TIMEOUT_SECONDS, and a right answer graded first would score 0; so the
    first parse runs once without a timeout (its input is fixed and tiny)."""
    from math_verify import LatexExtractionConfig, parse

    parse("\\boxed{1+1}", [LatexExtractionConfig()], parsing_timeout=None)  # pyright: ignore[reportArgumentType]


def _verify(gold: str, value: str) -> bool:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    _load_parsers()
    # signal.alarm exists only on the main thread (the pool's processes, a CLI). Elsewhere (a
    # trainer's evaluation in a thread) the guards above already bound the work: short, one value,
    # no power tower.
    timeout = VERIFY_TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None
    # Both sides boxed: math-verify then reads exactly the value, never a stray number.
    config = [LatexExtractionConfig(), ExprExtractionConfig()]
    # math-verify takes None for "no timeout" but annotates the parameter as int.
    gold_parsed = parse(f"\\boxed{{{gold}}}", config, parsing_timeout=timeout)  # pyright: ignore[reportArgumentType]
    answer_parsed = parse(f"\\boxed{{{value}}}", config, parsing_timeout=timeout)  # pyright: ignore[reportArgumentType]
    if not gold_parsed or not answer_parsed:
        return False
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=timeout))
