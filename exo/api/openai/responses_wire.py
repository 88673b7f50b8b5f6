"""Wire types of OpenAI Responses.

Bodies as msgspec decodes them: unknown fields are ignored on the surfaces (as their own servers
do) and forbidden on the cluster's routes; the handler modules validate the values."""

from __future__ import annotations

from typing import Any

import msgspec

from exo.core.ids import ModelId


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str = ""
    image_url: str | None = None  # input_image: a data: or http(s) URL
    file_id: str | None = None
    detail: str | None = None  # accepted; the model sees the image as its processor sizes it


class InputItem(msgspec.Struct, kw_only=True):
    type: str = "message"
    role: str = ""
    content: str | list[ContentPart] = ""
    call_id: str = ""  # function_call, function_call_output
    name: str = ""
    arguments: str = ""
    output: str | list[ContentPart] = ""


class FunctionTool(msgspec.Struct, kw_only=True):
    type: str
    name: str = ""
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedTool(msgspec.Struct, kw_only=True):
    type: str
    name: str = ""


class Reasoning(msgspec.Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None  # no summaries: the reasoning itself comes back as reasoning_text


class TextOptions(msgspec.Struct, kw_only=True):
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: ModelId
    service_tier: str | None = None  # "flex": the batch tier (exo/api/generation.py requested_tier)
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    text: TextOptions | None = None
    metadata: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None  # an extension, as Ollama's (exo/api/keep_alive.py)
