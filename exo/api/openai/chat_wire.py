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


class Constraints(msgspec.Struct, kw_only=True):
    """Fields that constrain the answer, at most one per request (exo/api/structured.py reads them):
    OpenAI's, vLLM's guided_* and structured_outputs, llama.cpp's grammar (GBNF) and json_schema."""

    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None

    def constraints(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in Constraints.__struct_fields__}


class ChatRequest(Constraints, kw_only=True):
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
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None  # vLLM's and mlx_lm.server's extensions, as validate.sampling_extensions reads them
    min_p: float | None = None
    repetition_penalty: float | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None
    keep_alive: str | int | float | None = None  # an extension, as Ollama's (exo/api/keep_alive.py)


class CompletionRequest(Constraints, kw_only=True):
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
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None  # as ChatRequest's
    min_p: float | None = None
    repetition_penalty: float | None = None
    user: str | None = None
    keep_alive: str | int | float | None = None  # an extension, as Ollama's (exo/api/keep_alive.py)
