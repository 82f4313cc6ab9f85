"""`ToolEnv`: a multi-turn environment whose turns are the results of the model's tool calls.

The model either calls a tool (in the configured `ToolCallFormat`) or answers. A call is parsed,
checked against the tool's signature and run; its result (or an `error: ...` line the model can
learn from) is the environment's turn. A turn that is not a call is the final answer. Tools must
be deterministic functions of their arguments: the coordinator replays every call.
"""

from __future__ import annotations

from collections.abc import Callable

from decentrl.envs.base import Message, Problem, final_answer
from decentrl.envs.toolcalls import TOOL_FORMATS, ToolFormatName
from decentrl.envs.tools import ToolError, call_tool, tool_schema

MAX_TOOL_OUTPUT_CHARS = 2000  # a tool result longer than this is cut: env tokens are not free


class ToolEnv:
    name = "tools"

    def __init__(self, tools: list[Callable], tool_format: ToolFormatName = "hermes", max_turns: int = 4):
        if tool_format not in TOOL_FORMATS:
            raise ValueError(f"tool_format must be one of {sorted(TOOL_FORMATS)}, got {tool_format!r}")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.functions = {fn.__name__: fn for fn in tools}
        self.tools = [tool_schema(fn) for fn in tools]
        self.tool_format = TOOL_FORMATS[tool_format]()
        self.max_turns = max_turns

    def respond(self, problem: Problem, messages: list[Message]) -> list[Message] | None:
        try:
            call = self.tool_format.parse(final_answer(messages))
            if call is None:
                return None
            result = str(call_tool(self.functions, call.name, call.args, call.kwargs))
        except ToolError as exc:
            result = f"error: {exc}"
        return [{"role": "tool", "content": result[:MAX_TOOL_OUTPUT_CHARS]}]

    def tool_results(self, messages: list[Message]) -> list[str]:
        """Contents of the environment's tool turns that were not errors."""
        return [
            str(m["content"])
            for m in messages
            if m["role"] == "tool" and not str(m["content"]).startswith("error:")
        ]
