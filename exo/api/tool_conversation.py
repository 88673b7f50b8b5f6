"""The one tool-call path under every API surface.

Each surface (OpenAI chat and Responses, Anthropic Messages, Ollama) turns its own shapes into
the same two things, both built here: OpenAI-style function tools for the chat template
(`offered_tools`, checked, with `required_call` for a call the request requires), and a
conversation of ChatMessages with ToolTurns beside them (assistant tool calls, tool results). The
runner renders them with the model's template and parses its calls with mlx-lm's parser; each
surface then shapes the parsed ToolCalls its own way.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from exo.api.errors import ApiError
from exo.api.tool_wire import FunctionTool, RequestToolCall, ToolChoice
from exo.core.grammar import tool_call_problem
from exo.core.requests import ChatMessage, ToolCall, ToolTurn


class Conversation:
    """Messages in order, with the tool side of the ones that have one."""

    def __init__(self) -> None:
        self.messages: list[ChatMessage] = []
        self.tool_turns: list[ToolTurn] = []

    def say(self, role: str, content: str, images: list[str] | None = None) -> None:
        self.messages.append(ChatMessage(role=role, content=content, images=images or []))

    def call(self, content: str, calls: list[ToolCall]) -> None:
        """An assistant turn that called tools; calls right after an assistant's text join it."""
        last = self.messages[-1] if self.messages else None
        turn = self.tool_turns[-1] if self.tool_turns else None
        if last is not None and last.role == "assistant" and not content:
            index = len(self.messages) - 1
            earlier = turn.tool_calls if turn is not None and turn.index == index else []
            if earlier:
                self.tool_turns.pop()
            self.tool_turns.append(ToolTurn(index=index, tool_calls=[*earlier, *calls]))
            return
        self.say("assistant", content)
        self.tool_turns.append(ToolTurn(index=len(self.messages) - 1, tool_calls=list(calls)))

    def answer(self, call_id: str, content: str, name: str = "") -> None:
        """A tool's result, as the `tool` message chat templates know."""
        self.say("tool", content)
        self.tool_turns.append(ToolTurn(index=len(self.messages) - 1, tool_call_id=call_id, name=name))


def arguments_object(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` and Ollama's `arguments` are. A model
    that wrote something other than a JSON object gets it under "arguments", not lost."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def arguments_text(arguments: Any, param: str) -> str:
    """A client's call arguments (an object) as the JSON text ToolCall keeps."""
    if not isinstance(arguments, dict):
        raise ApiError(400, f"{param} must be an object", param=param)
    return json.dumps(arguments, ensure_ascii=False)


def function_tool(name: str, description: str | None, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The OpenAI chat shape every surface's tool definitions become."""
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def offered_tools(tools: list[dict[str, Any]] | None, choice: str | ToolChoice | None) -> list[dict[str, Any]]:
    """The tools the template is given, as the client sent them: none for tool_choice "none",
    only the named one for a named choice (which `required_call` then enforces)."""
    for n, raw in enumerate(tools or []):
        tool = _checked_tool(n, raw)
        if tool.type != "function":
            raise ApiError(400, f"tools[{n}].type must be 'function'", param=f"tools[{n}].type")
        if not FUNCTION_NAME.match(tool.function.name):
            raise ApiError(400, "function names are 1-64 letters, digits, '_' or '-'", param=f"tools[{n}].function.name")
    if choice is not None and not tools:
        raise ApiError(400, "tool_choice is only allowed when tools are given", param="tool_choice")
    as_dicts = list(tools or [])
    if choice is None or choice in ("auto", "required"):
        return as_dicts
    if choice == "none":
        return []
    if isinstance(choice, str):
        raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or a named function", param="tool_choice")
    named = [t for t in as_dicts if t["function"]["name"] == choice.function.name]
    if choice.type != "function" or not named:
        raise ApiError(400, f"tool_choice names no tool in tools: {choice.function.name!r}", param="tool_choice")
    return named


def required_call(tools: list[dict[str, Any]], required: bool) -> bool:
    """Whether the answer must call one of `tools` ("required", or a named tool): decoding is then
    constrained to a call (exo/core/grammar.py); a 400 when the tools' parameters cannot be enforced."""
    if not (required and tools):
        return False
    if problem := tool_call_problem(tools):
        reason = problem.splitlines()[0].split(": ", 1)[-1]
        raise ApiError(400, f"a required tool call cannot be enforced for these tools: {reason}", param="tools")
    return True


def _checked_tool(n: int, raw: dict[str, Any]) -> FunctionTool:
    try:
        return msgspec.convert(raw, FunctionTool)
    except msgspec.ValidationError as error:
        message = str(error)
        where = message.rsplit("at `$", 1)[1].rstrip("`") if "at `$" in message else ""
        if "missing required field `" in message:
            where += "." + message.split("missing required field `", 1)[1].split("`", 1)[0]
        raise ApiError(400, f"invalid tools[{n}]: {message}", param=f"tools[{n}]{where}") from None


def tool_turn(index: int, role: str, tool_calls: list[RequestToolCall] | None,
              tool_call_id: str | None, name: str | None) -> ToolTurn | None:
    """The tool side of messages[index], or None for a plain message."""
    if role == "tool" and not tool_call_id:
        raise ApiError(400, f"messages[{index}] has role 'tool' but no tool_call_id", param=f"messages[{index}].tool_call_id")
    if tool_calls and role != "assistant":
        raise ApiError(400, f"messages[{index}]: only assistant messages carry tool_calls", param=f"messages[{index}].tool_calls")
    for n, call in enumerate(tool_calls or []):
        if call.type != "function":
            raise ApiError(400, "tool call type must be 'function'", param=f"messages[{index}].tool_calls[{n}].type")
    if not tool_calls and not tool_call_id and not name:
        return None
    calls = [ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments) for c in tool_calls or []]
    return ToolTurn(index=index, tool_calls=calls, tool_call_id=tool_call_id or "", name=name or "")
