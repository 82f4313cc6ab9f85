"""How a model writes a tool call, one format per class behind `ToolCallFormat`.

- `hermes`: `<tool_call>{"name": "lookup", "arguments": {"name": "kibo"}}</tool_call>`, the
  format of Qwen2.5/Hermes chat templates (what real checkpoints were trained on).
- `python`: the whole turn is one call expression, `lookup("kibo")`: short enough for the
  character-level tiny model. Arguments must be literals (parsed with `ast.literal_eval`, never
  evaluated), so a call cannot run code on the worker or the coordinator.

`parse` returns None for a turn that is not a call (a final answer) and raises ToolError for one
that tries to be a call but is malformed.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from decentrl.envs.tools import ToolError

ToolFormatName = Literal["hermes", "python"]


@dataclass(frozen=True)
class ToolCall:
    name: str
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)


class ToolCallFormat(Protocol):
    def parse(self, text: str) -> ToolCall | None: ...

    def render(self, call: ToolCall) -> str: ...


class HermesFormat:
    PATTERN = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ToolCall | None:
        match = self.PATTERN.search(text)
        if match is None:
            if "<tool_call>" in text:
                raise ToolError("unterminated <tool_call>; close it with </tool_call>")
            return None
        try:
            body = json.loads(match[1])
        except json.JSONDecodeError as exc:
            raise ToolError(f"tool call is not valid JSON: {exc.msg}") from None
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise ToolError('tool call must be {"name": str, "arguments": {...}}')
        arguments = body.get("arguments", {})
        if not isinstance(arguments, dict):
            raise ToolError("tool call arguments must be a JSON object")
        return ToolCall(body["name"], [], arguments)

    def render(self, call: ToolCall) -> str:
        assert not call.args, "hermes tool calls take keyword arguments only"
        return f"<tool_call>{json.dumps({'name': call.name, 'arguments': call.kwargs})}</tool_call>"


class PythonFormat:
    PATTERN = re.compile(r"^\s*[A-Za-z_]\w*\(.*\)\s*$", re.DOTALL)

    def parse(self, text: str) -> ToolCall | None:
        if not self.PATTERN.match(text):
            return None
        try:
            node = ast.parse(text.strip(), mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
            raise ToolError(f"cannot parse the tool call ({exc.__class__.__name__})") from None
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            raise ToolError("a tool call is name(arguments)")
        try:
            args = [ast.literal_eval(a) for a in node.args]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError) as exc:
            raise ToolError(
                f"cannot parse the tool call ({exc.__class__.__name__}); arguments must be literals"
            ) from None
        return ToolCall(node.func.id, args, kwargs)

    def render(self, call: ToolCall) -> str:
        parts = [repr(a) for a in call.args] + [f"{k}={v!r}" for k, v in call.kwargs.items()]
        return f"{call.name}({', '.join(parts)})"


TOOL_FORMATS: dict[str, type[ToolCallFormat]] = {"hermes": HermesFormat, "python": PythonFormat}
