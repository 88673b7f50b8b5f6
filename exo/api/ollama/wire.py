"""Wire types of Ollama's API.

Bodies as msgspec decodes them: unknown fields are ignored on the surfaces (as their own servers
do) and forbidden on the cluster's routes; the handler modules validate the values."""

from __future__ import annotations

from typing import Any

import msgspec

from exo.core.ids import ModelId


class Options(msgspec.Struct, kw_only=True):
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    num_predict: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None  # the window repeat_penalty looks at: -1 the whole context, 0 off


class CalledFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: dict[str, Any] = {}


class OllamaToolCall(msgspec.Struct, kw_only=True):
    function: CalledFunction


class OllamaMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None  # which tool a `tool` message answers


class ChatRequest(msgspec.Struct, kw_only=True):
    model: ModelId
    messages: list[OllamaMessage] = []
    stream: bool = True
    options: Options | None = None
    format: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    keep_alive: str | int | float | None = None
    think: bool | str | None = None


class GenerateRequest(msgspec.Struct, kw_only=True):
    model: ModelId
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    stream: bool = True
    options: Options | None = None
    format: str | dict[str, Any] | None = None
    images: list[str] | None = None
    suffix: str | None = None
    think: bool | str | None = None
    keep_alive: str | int | float | None = None


class ModelRequest(msgspec.Struct, kw_only=True):
    model: ModelId = ModelId("")
    name: str = ""  # older clients send "name"


class PullRequest(msgspec.Struct, kw_only=True):
    model: ModelId = ModelId("")
    name: str = ""  # older clients send "name"
    insecure: bool = False  # Ollama's registry over plain HTTP: nothing here to apply it to
    stream: bool = True
