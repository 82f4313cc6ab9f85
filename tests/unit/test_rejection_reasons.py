"""Rejection reasons are one closed set: every reason the coordinator raises is a `Reason`, every
`Reason` is raised somewhere, and the strike list names only reasons that are raised."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import decentrl
from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.coordinator.trust.reputation import HOSTILE_REASONS
from decentrl.trust import replay_guard

SOURCES = Path(decentrl.__file__).parent
PASSED_ON = {"reason"}
"""`error.reason`, `replayed.reason`, a `reason` parameter: a reason made elsewhere, passed on (and
checked by `ApiError` itself, which turns it into a `Reason` or raises)."""


def _reason_argument(call: ast.Call) -> ast.expr | None:
    for keyword in call.keywords:
        if keyword.arg == "reason":
            return keyword.value
    return call.args[2] if len(call.args) > 2 else None


def _raised() -> tuple[set[str], list[str]]:
    """Members named as `Reason.X` anywhere in the package, and every ApiError whose reason is
    neither such a member nor a reason passed on."""
    named: set[str] = set()
    loose: list[str] = []
    for path in SOURCES.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "Reason"
            ):
                named.add(node.attr)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ApiError":
                argument = _reason_argument(node)
                ok = (isinstance(argument, ast.Name) and argument.id in PASSED_ON) or (
                    isinstance(argument, ast.Attribute)
                    and (getattr(argument.value, "id", None) == "Reason" or argument.attr in PASSED_ON)
                )
                if not ok:
                    loose.append(f"{path.relative_to(SOURCES)}:{node.lineno}")
    return named, loose


def test_every_raised_reason_is_a_member_and_every_member_is_raised() -> None:
    named, loose = _raised()
    # The trust library (which imports no coordinator code) names its replay refusals as strings;
    # the gate turns them into members.
    named |= {
        Reason(reason).name
        for reason in (replay_guard.CLOCK_SKEW, replay_guard.REPLAY, replay_guard.MALFORMED)
    }
    assert loose == [], f"ApiError reasons that are not Reason members: {loose}"
    members = {member.name for member in Reason}
    assert named <= members, named - members
    assert members <= named, f"members nothing raises: {members - named}"


def test_the_strike_list_names_only_raised_reasons() -> None:
    named, _ = _raised()
    named |= {
        Reason(reason).name
        for reason in (replay_guard.CLOCK_SKEW, replay_guard.REPLAY, replay_guard.MALFORMED)
    }
    assert {reason.name for reason in HOSTILE_REASONS} <= named
    # nothing a third party can send is a strike
    assert not {Reason.BAD_SIGNATURE, Reason.REPLAY, Reason.CLOCK_SKEW, Reason.AUTH} & HOSTILE_REASONS
    assert ApiError(422, "x", "schema").reason is Reason.SCHEMA
    with pytest.raises(ValueError):
        ApiError(422, "x", "made_up")
