"""The one tool-call path under every API surface.

Each surface (OpenAI chat and Responses, Anthropic Messages, Ollama) turns its own shapes into
the same two things: OpenAI-style function tools for the chat template (`offered_tools` in
openai_tools.py), and a conversation of ChatMessages with ToolTurns beside them (assistant tool
calls, tool results), built here. The runner renders them with the model's template and parses
its calls with mlx-lm's parser; each surface then shapes the parsed ToolCalls its own way.
"""

from __future__ import annotations

import json
from typing import Any

from exo.api.errors import ApiError
from exo.core.types import ChatMessage, ToolCall, ToolTurn


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
