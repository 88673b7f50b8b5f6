"""Wire types of OpenAI chat completions and completions.

Bodies as msgspec decodes them: unknown fields are ignored on the surfaces (as their own servers
do) and forbidden on the cluster's routes; the handler modules validate the values."""

from __future__ import annotations

from typing import Any

import msgspec

from exo.api.tool_wire import RequestToolCall, ToolChoice
from exo.core.ids import ModelId

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ImageUrl(msgspec.Struct, kw_only=True):
    url: str
    detail: str = "auto"


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str = ""
    image_url: ImageUrl | None = None


class ChatRequestMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[RequestToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class ChatRequest(msgspec.Struct, kw_only=True):
    model: ModelId
    service_tier: str | None = None  # "flex": the batch tier (served after interactive requests)
    priority: int | None = None  # vLLM's: above 0, the batch tier
    messages: list[ChatRequestMessage]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None
    response_format: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None  # an extension, as Ollama's (exo/api/keep_alive.py)


class CompletionRequest(msgspec.Struct, kw_only=True):
    model: ModelId
    service_tier: str | None = None  # as ChatRequest's
    priority: int | None = None
    prompt: str | list[str]
    max_tokens: int | None = COMPLETIONS_MAX_TOKENS
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    keep_alive: str | int | float | None = None  # an extension, as Ollama's (exo/api/keep_alive.py)
