"""POST /v1/chat/completions in OpenAI's shapes, streaming (SSE) and not."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from exo.api import thinking
from exo.api.choices import check_n
from exo.api.context import context_of
from exo.api.errors import ApiError
from exo.api.generation import generating, requested_tier
from exo.api.images import USER_ONLY, ImageUploads
from exo.api.keep_alive import keep_alive_seconds
from exo.api.openai.chat_stream import complete_chat, parse_event_id, resume_chat, stream_chat
from exo.api.openai.chat_wire import ChatRequest, ChatRequestMessage
from exo.api.request_body import decode_body
from exo.api.structured import openai_constraint
from exo.api.tool_conversation import offered_tools, required_call, tool_turn
from exo.api.tool_wire import ToolChoice
from exo.api.validate import check_logprobs, check_penalty, sampling_extensions
from exo.core.requests import ChatMessage, GenerationParams

_ROLES = {"system", "developer", "user", "assistant", "tool"}


def to_params(body: ChatRequest, uploads: ImageUploads) -> GenerationParams:
    if not body.messages:
        raise ApiError(400, "messages must contain at least one message", param="messages")
    n = check_n(body.n)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, "max_tokens must be at least 1", param="max_tokens")
    if body.temperature is not None and not 0 <= body.temperature <= 2:
        raise ApiError(400, "temperature must be between 0 and 2", param="temperature")
    if body.top_p is not None and not 0 <= body.top_p <= 1:
        raise ApiError(400, "top_p must be between 0 and 1", param="top_p")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return GenerationParams(
        messages=[_to_message(i, m, uploads) for i, m in enumerate(body.messages)],
        max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed, stop=stop, n=n,
        **_openai_extras(body),
    )


def _openai_extras(body: ChatRequest) -> dict[str, Any]:
    """Penalties, logprobs, tools, the answer's format and the thinking switch, validated, as GenerationParams fields."""
    turns = [tool_turn(i, m.role, m.tool_calls, m.tool_call_id, m.name) for i, m in enumerate(body.messages)]
    tools = offered_tools(body.tools, body.tool_choice)
    required = required_call(tools, body.tool_choice == "required" or isinstance(body.tool_choice, ToolChoice))
    response_format = openai_constraint(body.constraints())
    if required and response_format is not None:
        raise ApiError(400, "a required tool call and a response_format cannot be combined", param="response_format")
    return {
        "presence_penalty": check_penalty(body.presence_penalty, "presence_penalty"),
        "frequency_penalty": check_penalty(body.frequency_penalty, "frequency_penalty"),
        **sampling_extensions(body.top_k, body.min_p, body.repetition_penalty, body.logit_bias),
        "logprobs": body.logprobs,
        "top_logprobs": check_logprobs(body.logprobs, body.top_logprobs),
        "tools": tools,
        "tools_required": required,
        "tool_turns": [t for t in turns if t is not None],
        "response_format": response_format,
        "enable_thinking": thinking.first_of(thinking.from_template_kwargs(body.chat_template_kwargs), body.enable_thinking,
                                             thinking.from_effort(body.reasoning_effort, "reasoning_effort")),
    }


def _to_message(index: int, message: ChatRequestMessage, uploads: ImageUploads) -> ChatMessage:
    if message.role not in _ROLES:
        raise ApiError(400, f"messages[{index}].role must be one of {sorted(_ROLES)}", param=f"messages[{index}].role")
    content = message.content
    if not isinstance(content, list):
        return ChatMessage(role=message.role, content=content or "")
    texts: list[str] = []
    images: list[str] = []
    for n, part in enumerate(content):
        param = f"messages[{index}].content[{n}]"
        if part.type == "text":
            texts.append(part.text)
        elif part.type == "image_url" and part.image_url is not None:
            if message.role != "user":
                raise ApiError(400, f"{USER_ONLY}, not in a {message.role!r} one", param=param)
            images.append(uploads.add_image_url(part.image_url.url, param))
        else:
            raise ApiError(400, f"content part type {part.type!r} is not supported", param=param)
    return ChatMessage(role=message.role, content="".join(texts), images=images)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    if "Last-Event-ID" in request.headers:  # a dropped stream reconnecting: the same generation, not a new one
        command_id, after = parse_event_id(request.headers["Last-Event-ID"])
        return await resume_chat(request, command_id, after, include_usage=_wants_usage(await request.read()))
    body = await decode_body(request, ChatRequest)
    uploads = ImageUploads(context_of(request).settings)
    params = await uploads.with_fetched_images(to_params(body, uploads))
    ctx = context_of(request)
    grace = ctx.settings.resume_grace_s if body.stream else 0.0
    async with generating(ctx, body.model, params, resume_grace_s=grace, tier=requested_tier(body.service_tier, body.priority),
                          storing=uploads.stored(ctx, body.model),
                          keep_alive_s=keep_alive_seconds(body.keep_alive)) as generation:
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await stream_chat(request, generation, body.model, include_usage, body.logprobs, n=body.n)
        return await complete_chat(generation, body.model, body.logprobs)


def _wants_usage(raw: bytes) -> bool:
    try:
        return bool(msgspec.json.decode(raw or b"{}", type=dict).get("stream_options", {}).get("include_usage"))
    except (msgspec.DecodeError, AttributeError):
        return False
