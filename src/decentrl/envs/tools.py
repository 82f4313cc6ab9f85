"""Tools declared as typed Python callables: JSON Schema from the signature and the docstring.

`tool_schema(fn)` gives the OpenAI-style declaration that chat templates render (`tools=`):
parameter types from the annotations, the description from the docstring's first paragraph and
per-parameter descriptions from its `Args:` section (Google style). `call_tool` checks a model's
arguments against the same signature before calling, so a malformed call is an error message,
never an exception inside the environment.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, get_args, get_origin

JSON_TYPES: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


class ToolError(ValueError):
    """A tool call the environment refuses (unknown tool, bad arguments); shown to the model."""


def _json_type(annotation: Any) -> dict:
    origin = get_origin(annotation)
    if annotation in JSON_TYPES:
        return {"type": JSON_TYPES[annotation]}
    if origin is Literal:
        return {"enum": list(get_args(annotation))}
    if origin in (list, tuple, set, frozenset):
        args = [a for a in get_args(annotation) if a is not Ellipsis]
        return {"type": "array", **({"items": _json_type(args[0])} if args else {})}
    if origin is dict:
        return {"type": "object"}
    if origin in (typing.Union, types.UnionType):
        options = [_json_type(a) for a in get_args(annotation) if a is not type(None)]
        return options[0] if len(options) == 1 else {"anyOf": options}
    raise TypeError(
        f"tool parameter type {annotation!r} has no JSON Schema mapping; use str, int, float, bool, list, Literal"
    )


def _docstring_parts(fn: Callable) -> tuple[str, dict[str, str]]:
    doc = inspect.getdoc(fn) or ""
    summary = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    described: dict[str, str] = {}
    args = re.search(r"^Args:\n((?:[ \t]+.*\n?)+)", doc, re.MULTILINE)
    if args:
        for line in args[1].splitlines():
            match = re.match(r"\s+(\w+)(?:\s*\(.*?\))?:\s*(.*)", line)
            if match:
                described[match[1]] = match[2].strip()
    return summary, described


def tool_schema(fn: Callable) -> dict:
    """OpenAI-style function declaration of `fn` (every parameter must be annotated)."""
    hints = typing.get_type_hints(fn)
    summary, described = _docstring_parts(fn)
    properties, required = {}, []
    for name, parameter in inspect.signature(fn).parameters.items():
        if name not in hints:
            raise TypeError(f"tool {fn.__name__}: parameter {name!r} needs a type annotation")
        properties[name] = _json_type(hints[name]) | (
            {"description": described[name]} if name in described else {}
        )
        if parameter.default is inspect.Parameter.empty:
            required.append(name)
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": fn.__name__, "description": summary, "parameters": parameters},
    }


def _matches(value: Any, annotation: Any) -> bool:
    origin = get_origin(annotation)
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation in JSON_TYPES:
        return isinstance(value, annotation) and (annotation is bool or not isinstance(value, bool))
    if origin is Literal:
        return value in get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in get_args(annotation))
    if annotation is type(None):
        return value is None
    if origin in (list, tuple, set, frozenset):
        return isinstance(value, list | tuple)
    if origin is dict:
        return isinstance(value, dict)
    return True


def call_tool(tools: dict[str, Callable], name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """Call tool `name` after checking the arguments against its signature; ToolError otherwise."""
    if name not in tools:
        raise ToolError(f"unknown tool {name!r}; available: {', '.join(sorted(tools))}")
    fn = tools[name]
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as exc:
        raise ToolError(f"{name}: {exc}") from None
    hints = typing.get_type_hints(fn)
    for key, value in bound.arguments.items():
        if not _matches(value, hints[key]):
            raise ToolError(f"{name}: argument {key!r} must be {_json_type(hints[key])}, got {value!r}")
    return fn(*bound.args, **bound.kwargs)
