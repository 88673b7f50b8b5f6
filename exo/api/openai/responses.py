"""POST /v1/responses in OpenAI's shapes: message and function-call items in (`input_image`
parts with data: or http(s) URLs among them), message and function_call items out, and its typed
event stream (openai_responses_stream.py)."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from exo.api.collect import collect
from exo.api.context import context_of
from exo.api.errors import ApiError
from exo.api.generation import generating, requested_tier
from exo.api.images import URL_KINDS, USER_ONLY, ImageUploads
from exo.api.keep_alive import keep_alive_seconds
from exo.api.openai.responses_stream import Answer, response_body, stream_response
from exo.api.openai.responses_wire import ContentPart, InputItem, NamedTool, ResponsesRequest
from exo.api.request_body import decode_body
from exo.api.structured import responses_format
from exo.api.thinking import from_effort
from exo.api.tool_conversation import Conversation, function_tool, offered_tools, required_call
from exo.api.tool_wire import NamedFunction, ToolChoice
from exo.api.validate import at_least_one, in_range
from exo.core.requests import GenerationParams, ToolCall

_ROLES = {"user", "assistant", "system", "developer"}
_TEXT_PARTS = {"input_text", "output_text", "text"}
_DROPPED_ITEMS = {"reasoning"}  # the model's own notes from an earlier turn: not part of the prompt


def _content(content: str | list[ContentPart], param: str, uploads: ImageUploads | None) -> tuple[str, list[str]]:
    """The text of a message's (or a function output's) parts, and the digests of its images
    (where `uploads` takes them: a user message)."""
    if isinstance(content, str):
        return content, []
    images = []
    for k, part in enumerate(content):
        if part.type == "input_image":
            if uploads is None:
                raise ApiError(400, f"{USER_ONLY}: input_image parts belong in user messages", param=f"{param}[{k}].type")
            images.append(_image(part, f"{param}[{k}]", uploads))
        elif part.type not in _TEXT_PARTS:
            raise ApiError(400, f"content part type {part.type!r} is not supported", param=f"{param}[{k}].type")
    return "".join(p.text for p in content if p.type in _TEXT_PARTS), images


def _image(part: ContentPart, param: str, uploads: ImageUploads) -> str:
    if part.file_id is not None:
        raise ApiError(400, f"input_image file_id is not supported: this server keeps no files; send image_url as {URL_KINDS}",
                       param=f"{param}.file_id")
    if part.image_url is None:
        raise ApiError(400, f"input_image needs image_url ({URL_KINDS})", param=f"{param}.image_url")
    return uploads.add_image_url(part.image_url, f"{param}.image_url")


def _add_item(conversation: Conversation, n: int, item: InputItem, uploads: ImageUploads) -> None:
    param = f"input[{n}]"
    if item.type == "message":
        if item.role not in _ROLES:
            raise ApiError(400, f"{param} must be a message with role one of {sorted(_ROLES)}", param=param)
        conversation.say(item.role, *_content(item.content, f"{param}.content", uploads if item.role == "user" else None))
    elif item.type == "function_call":
        if not (item.call_id and item.name):
            raise ApiError(400, f"{param}: a function_call needs call_id and name", param=param)
        conversation.call("", [ToolCall(id=item.call_id, name=item.name, arguments=item.arguments or "{}")])
    elif item.type == "function_call_output":
        if not item.call_id:
            raise ApiError(400, f"{param}: a function_call_output needs call_id", param=f"{param}.call_id")
        conversation.answer(item.call_id, _content(item.output, f"{param}.output", None)[0])
    elif item.type not in _DROPPED_ITEMS:
        raise ApiError(400, f"{param}: item type {item.type!r} is not supported", param=f"{param}.type")


def _tools(body: ResponsesRequest) -> list[dict[str, Any]]:
    tools = []
    for n, tool in enumerate(body.tools or []):
        if tool.type != "function":
            raise ApiError(400, f"tools[{n}]: tool type {tool.type!r} is not supported; only 'function'",
                           param=f"tools[{n}].type")
        tools.append(function_tool(tool.name, tool.description, tool.parameters))
    choice = body.tool_choice
    if isinstance(choice, NamedTool):
        if choice.type != "function":
            raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or a function", param="tool_choice.type")
        return offered_tools(tools, ToolChoice(type="function", function=NamedFunction(name=choice.name)))
    return offered_tools(tools, choice if tools or choice not in ("auto", "none") else None)


def to_params(body: ResponsesRequest, uploads: ImageUploads) -> GenerationParams:
    if body.previous_response_id:
        raise ApiError(400, "previous_response_id is not supported: responses are not stored", param="previous_response_id")
    items = [InputItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    if not items:
        raise ApiError(400, "input must not be empty", param="input")
    conversation = Conversation()
    if body.instructions:
        conversation.say("system", body.instructions)
    for n, item in enumerate(items):
        _add_item(conversation, n, item, uploads)
    tools = _tools(body)
    required = required_call(tools, body.tool_choice == "required" or isinstance(body.tool_choice, NamedTool))
    response_format = responses_format(body.text.format if body.text else None)
    if required and response_format is not None:
        raise ApiError(400, "a required tool call and text.format cannot be combined", param="text.format")
    return GenerationParams(
        messages=conversation.messages, tool_turns=conversation.tool_turns, tools=tools, tools_required=required,
        max_tokens=at_least_one(body.max_output_tokens, "max_output_tokens"),
        temperature=in_range(body.temperature, 0.0, 2.0, "temperature"), top_p=in_range(body.top_p, 0.0, 1.0, "top_p"),
        enable_thinking=from_effort(body.reasoning.effort if body.reasoning else None, "reasoning.effort"),
        response_format=response_format,
    )


async def responses(request: web.Request) -> web.StreamResponse:
    body = await decode_body(request, ResponsesRequest)
    uploads = ImageUploads(context_of(request).settings)
    params = await uploads.with_fetched_images(to_params(body, uploads))
    echo = _echo(body)
    ctx = context_of(request)
    async with generating(ctx, body.model, params, storing=uploads.stored(ctx, body.model, "input"),
                          tier=requested_tier(body.service_tier, None),
                          keep_alive_s=keep_alive_seconds(body.keep_alive)) as generation:
        if body.stream:
            return await stream_response(request, generation, echo)
        done = await collect(generation)
        assert done.final is not None
        answer = Answer(generation.command_id)
        answer.add_whole(done.reasoning, done.text, done.tool_calls)
        return web.json_response(response_body(generation.command_id, echo, "completed", answer.items(), done.final))


def _echo(body: ResponsesRequest) -> dict[str, Any]:
    """What a response repeats of its request."""
    choice = body.tool_choice
    return {"model": body.model, "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
            "tool_choice": msgspec.to_builtins(choice) if choice is not None else "auto",
            "tools": msgspec.to_builtins(body.tools or []),
            "text": {"format": (body.text.format if body.text else None) or {"type": "text"}}}
