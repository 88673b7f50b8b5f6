"""POST /v1/messages/count_tokens in Anthropic's shape (Claude Code calls it): the tokens of the
prompt /v1/messages would send, through the same conversion (messages.to_params) and the same
template call as the runner's, on the API node with no runner (exo/api/token_counts.py)."""

from __future__ import annotations

import asyncio

import msgspec
from aiohttp import web

from exo.api.anthropic.messages import to_params
from exo.api.anthropic.wire import AnthropicToolChoice, ContentBlock, Message, MessagesRequest, ThinkingConfig, Tool
from exo.api.context import context_of
from exo.api.errors import ApiError
from exo.api.images import ImageUploads
from exo.api.request_body import decode_body
from exo.api.token_counts import checked_length, countable, counting_card, tokenizer_for
from exo.core.chat_template import encode_prompt, render_prompt, template_messages
from exo.core.ids import ModelId


class CountTokensRequest(msgspec.Struct, kw_only=True):
    model: ModelId
    messages: list[Message]
    system: str | list[ContentBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None


async def count_tokens(request: web.Request) -> web.Response:
    body = await decode_body(request, CountTokensRequest)
    ctx = context_of(request)
    if ctx.card(body.model) is None:  # as /v1/messages answers an unknown model
        raise ApiError(404, f"model: {body.model!r} does not exist", param="model")
    card = counting_card(request, body.model)
    as_message = MessagesRequest(model=body.model, messages=body.messages, max_tokens=1, system=body.system,
                                 tools=body.tools, tool_choice=body.tool_choice, thinking=body.thinking)
    params = countable(to_params(as_message, ImageUploads(ctx.settings)))
    tokenizer = await tokenizer_for(request, card)
    prompt = checked_length(await asyncio.to_thread(render_prompt, tokenizer.wrapper, template_messages(params),
                                                    params.tools, params.enable_thinking), "messages")
    tokens = await asyncio.to_thread(encode_prompt, tokenizer.wrapper, prompt)
    return web.json_response({"input_tokens": len(tokens)})
