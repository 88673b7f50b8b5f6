"""POST /v1/messages in Anthropic's shapes: system prompt, stop sequences, client tools
(`tool_use` / `tool_result` blocks), `image` blocks (base64 or url sources) in user messages, usage, and the
message_start ... message_stop event stream (anthropic_stream.py)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from exo.api import thinking
from exo.api.anthropic.stream import content_blocks, stop_fields, stream_message, usage
from exo.api.anthropic.wire import ContentBlock, Message, MessagesRequest
from exo.api.collect import collect
from exo.api.context import context_of
from exo.api.errors import ApiError
from exo.api.generation import Generation, generating
from exo.api.images import USER_ONLY, ImageUploads
from exo.api.keep_alive import keep_alive_seconds
from exo.api.request_body import decode_body
from exo.api.tool_conversation import FUNCTION_NAME, Conversation, arguments_text, function_tool, offered_tools, required_call
from exo.api.tool_wire import NamedFunction, ToolChoice
from exo.api.validate import at_least_one, in_range
from exo.core.requests import GenerationParams, ToolCall

# Blocks a client sends back that only mattered to the model that wrote them: dropped.
_DROPPED_BLOCKS = {"thinking", "redacted_thinking"}


def _text_of(content: str | list[ContentBlock], param: str) -> str:
    if isinstance(content, str):
        return content
    for n, block in enumerate(content):
        if block.type == "image":
            raise ApiError(400, f"{USER_ONLY}, not in a system prompt or a tool_result", param=f"{param}[{n}].type")
        if block.type != "text":
            raise ApiError(400, f"content block type {block.type!r} is not supported here", param=f"{param}[{n}].type")
    return "".join(block.text for block in content)


def _image(block: ContentBlock, param: str, uploads: ImageUploads) -> str:
    source = block.source
    if source is None:
        raise ApiError(400, f"{param}.source is required", param=f"{param}.source")
    if source.type == "url":
        return uploads.add_image_url(source.url, f"{param}.source.url")
    if source.type != "base64":
        raise ApiError(400, f"image source type {source.type!r} is not supported; use 'base64' or 'url'",
                       param=f"{param}.source.type")
    return uploads.add_base64(source.data, f"{param}.source.data")


def _add_message(conversation: Conversation, n: int, message: Message, uploads: ImageUploads) -> None:
    """One Anthropic message: tool results become `tool` messages before the user's text; an
    assistant's tool_use blocks become its tool calls. Images come only from the user."""
    param = f"messages[{n}].content"
    if isinstance(message.content, str):
        conversation.say(message.role, message.content)
        return
    texts: list[str] = []
    images: list[str] = []
    calls: list[ToolCall] = []
    for k, block in enumerate(message.content):
        where = f"{param}[{k}]"
        if block.type == "text":
            texts.append(block.text)
        elif block.type == "image" and message.role == "user":
            images.append(_image(block, where, uploads))
        elif block.type == "tool_use" and message.role == "assistant":
            calls.append(ToolCall(id=_required(block.id, f"{where}.id"), name=_required(block.name, f"{where}.name"),
                                  arguments=arguments_text(block.input if block.input is not None else {}, f"{where}.input")))
        elif block.type == "tool_result" and message.role == "user":
            conversation.answer(_required(block.tool_use_id, f"{where}.tool_use_id"), _text_of(block.content, f"{where}.content"))
        elif block.type not in _DROPPED_BLOCKS or message.role != "assistant":
            raise ApiError(400, f"content block type {block.type!r} is not supported in a {message.role} message",
                           param=f"{where}.type")
    if calls:
        conversation.call("".join(texts), calls)
    elif texts or images or message.role == "assistant":
        conversation.say(message.role, "".join(texts), images)


def _required(value: str, param: str) -> str:
    if not value:
        raise ApiError(400, f"{param} is required", param=param)
    return value


def _tools(body: MessagesRequest) -> list[dict[str, Any]]:
    """Anthropic's client tools as the function tools the chat template sees, `tool_choice` applied."""
    tools = []
    for n, tool in enumerate(body.tools or []):
        if tool.type not in (None, "custom"):
            raise ApiError(400, f"tools[{n}]: server tool {tool.type!r} is not supported; only client tools (with "
                                "input_schema)", param=f"tools[{n}].type")
        if not FUNCTION_NAME.match(tool.name):
            raise ApiError(400, "tool names are 1-64 letters, digits, '_' or '-'", param=f"tools[{n}].name")
        if tool.input_schema is None:
            raise ApiError(400, f"tools[{n}].input_schema is required", param=f"tools[{n}].input_schema")
        tools.append(function_tool(tool.name, tool.description, tool.input_schema))
    choice = body.tool_choice
    if choice is None:
        return offered_tools(tools, None)
    if choice.type == "tool":
        if not choice.name:
            raise ApiError(400, "tool_choice.name is required for type 'tool'", param="tool_choice.name")
        return offered_tools(tools, ToolChoice(type="function", function=NamedFunction(name=choice.name)))
    openai_choice = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)
    if openai_choice is None:
        raise ApiError(400, "tool_choice.type must be 'auto', 'any', 'tool' or 'none'", param="tool_choice.type")
    return offered_tools(tools, openai_choice if tools else None)


def to_params(body: MessagesRequest, uploads: ImageUploads) -> GenerationParams:
    if not body.messages:
        raise ApiError(400, "messages: at least one message is required", param="messages")
    conversation = Conversation()
    if body.system:
        conversation.say("system", _text_of(body.system, "system"))
    for n, message in enumerate(body.messages):
        if message.role not in ("user", "assistant"):
            raise ApiError(400, f"messages[{n}].role must be 'user' or 'assistant'", param=f"messages[{n}].role")
        _add_message(conversation, n, message, uploads)
    tools = _tools(body)
    choice = body.tool_choice.type if body.tool_choice else "auto"
    return GenerationParams(
        messages=conversation.messages, tool_turns=conversation.tool_turns, tools=tools,
        tools_required=required_call(tools, choice in ("any", "tool")),
        max_tokens=at_least_one(body.max_tokens, "max_tokens"),
        temperature=in_range(body.temperature, 0.0, 1.0, "temperature"), top_p=in_range(body.top_p, 0.0, 1.0, "top_p"),
        top_k=at_least_one(body.top_k, "top_k"), stop=list(body.stop_sequences or []),
        enable_thinking=thinking.from_anthropic(body.thinking.type if body.thinking else None),
    )


async def messages(request: web.Request) -> web.StreamResponse:
    body = await decode_body(request, MessagesRequest)
    uploads = ImageUploads(context_of(request).settings)
    params = await uploads.with_fetched_images(to_params(body, uploads))
    ctx = context_of(request)
    missing = ApiError(404, f"model: {body.model!r} does not exist", param="model")
    async with generating(ctx, body.model, params, missing, storing=uploads.stored(ctx, body.model),
                          keep_alive_s=keep_alive_seconds(body.keep_alive)) as generation:
        if body.stream:
            return await stream_message(request, generation, body.model)
        return await _complete(generation, body.model)


async def _complete(generation: Generation, model: str) -> web.Response:
    done = await collect(generation)
    assert done.final is not None
    return web.json_response({
        "id": f"msg_{generation.command_id}", "type": "message", "role": "assistant", "model": model,
        "content": content_blocks(done.text, done.tool_calls, done.reasoning),
        "usage": usage(done.final) | {"output_tokens": done.final.token_count},
    } | stop_fields(done.final, bool(done.tool_calls)))
