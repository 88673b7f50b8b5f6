"""Wire types of Anthropic messages.

Bodies as msgspec decodes them: unknown fields are ignored on the surfaces (as their own servers
do) and forbidden on the cluster's routes; the handler modules validate the values."""

from __future__ import annotations

from typing import Any

import msgspec

from exo.core.ids import ModelId


class ImageSource(msgspec.Struct, kw_only=True):
    type: str
    media_type: str = ""  # not checked: the image's bytes say what they are
    data: str = ""  # base64
    url: str = ""


class ContentBlock(msgspec.Struct, kw_only=True):
    type: str
    text: str = ""
    source: ImageSource | None = None  # image
    id: str = ""  # tool_use
    name: str = ""
    input: dict[str, Any] | None = None
    tool_use_id: str = ""  # tool_result
    content: str | list[ContentBlock] = ""
    is_error: bool = False


class Message(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentBlock]


class Tool(msgspec.Struct, kw_only=True):
    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None  # "custom", or one of Anthropic's own server tools


class AnthropicToolChoice(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(msgspec.Struct, kw_only=True):
    type: str
    budget_tokens: int | None = None  # not enforced: the model thinks until it closes its thinking


class MessagesRequest(msgspec.Struct, kw_only=True):
    model: ModelId
    messages: list[Message]
    max_tokens: int
    system: str | list[ContentBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    keep_alive: str | int | float | None = None  # an extension, as Ollama's (exo/api/keep_alive.py)
