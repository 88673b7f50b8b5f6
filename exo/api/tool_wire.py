"""Tools as requests carry them: OpenAI's shapes, which exo takes as the common form of every surface
(Anthropic's and Ollama's tools are turned into these; exo/api/tool_conversation.py)."""

from __future__ import annotations

from typing import Any

import msgspec


class FunctionDef(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(msgspec.Struct, kw_only=True):
    type: str
    function: FunctionDef


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class ToolChoice(msgspec.Struct, kw_only=True):
    type: str
    function: NamedFunction


class CalledFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: str = "{}"


class RequestToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: str = "function"
    function: CalledFunction
