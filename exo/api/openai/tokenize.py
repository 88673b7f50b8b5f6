"""POST /tokenize and /detokenize, in vLLM's shapes ({model, prompt} or {model, messages, ...} ->
{count, max_model_len, tokens, token_strs}; {model, tokens} -> {prompt}) and llama.cpp's
({content, add_special, with_pieces} -> {tokens}; {tokens} -> {content}), told apart by their
fields. llama.cpp's name no model: the only model placed is meant. Messages are rendered as
/v1/chat/completions renders them; no runner is asked (exo/api/token_counts.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp import web

from exo.api.context import context_of
from exo.api.errors import ApiError
from exo.api.images import ImageUploads
from exo.api.openai.chat import to_params
from exo.api.openai.chat_wire import ChatRequest, ChatRequestMessage
from exo.api.request_body import decode_body
from exo.api.token_counts import MAX_TOKEN_IDS, checked_length, countable, counting_card, only_placed_model, tokenizer_for
from exo.api.tokenizers import ModelTokenizer
from exo.core.chat_template import render_prompt, template_messages
from exo.core.ids import ModelId


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: ModelId | None = None
    prompt: str | None = None  # vLLM, a completion's prompt
    messages: list[ChatRequestMessage] | None = None  # vLLM, a chat's messages
    add_special_tokens: bool | None = None  # vLLM; None: true for a prompt, false for messages (templates add them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False
    content: str | None = None  # llama.cpp
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: ModelId | None = None  # vLLM's names it; llama.cpp's does not


async def tokenize(request: web.Request) -> web.Response:
    body = await decode_body(request, TokenizeRequest)
    vllm = body.prompt is not None or body.messages is not None
    if vllm and body.content is not None:
        raise ApiError(400, "send content (llama.cpp's shape) or prompt / messages (vLLM's), not both", param="content")
    if not vllm and body.content is None:
        raise ApiError(400, "one of prompt, messages (vLLM's shape) or content (llama.cpp's) is required", param="prompt")
    ctx = context_of(request)
    card = counting_card(request, only_placed_model(ctx, body.model))
    tokenizer = await tokenizer_for(request, card)
    if body.content is not None:
        return web.json_response(await _llama_tokenize(tokenizer, body.content, body.add_special, body.with_pieces))
    tokens = await _vllm_tokens(request, tokenizer, body)
    return web.json_response({
        "count": len(tokens), "max_model_len": ctx.view.state.max_context_of(card.model_id) or card.context_length,
        "tokens": tokens, "token_strs": tokenizer.wrapper.convert_ids_to_tokens(tokens) if body.return_token_strs else None,
    })


async def detokenize(request: web.Request) -> web.Response:
    body = await decode_body(request, DetokenizeRequest)
    card = counting_card(request, only_placed_model(context_of(request), body.model))
    if len(body.tokens) > MAX_TOKEN_IDS:
        raise ApiError(400, f"tokens: at most {MAX_TOKEN_IDS} token ids, got {len(body.tokens)}", param="tokens")
    tokenizer = await tokenizer_for(request, card)
    bad = next((n for n, token in enumerate(body.tokens) if not 0 <= token < tokenizer.vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"tokens[{bad}]: {body.tokens[bad]} is not a token id of {card.model_id!r} (0 to "
                            f"{tokenizer.vocab_size - 1})", param=f"tokens[{bad}]")
    text: str = await asyncio.to_thread(tokenizer.wrapper.decode, body.tokens)
    return web.json_response({"prompt": text} if body.model is not None else {"content": text})


async def _llama_tokenize(tokenizer: ModelTokenizer, content: str, add_special: bool, with_pieces: bool) -> dict[str, Any]:
    tokens: list[int] = await asyncio.to_thread(tokenizer.wrapper.encode, checked_length(content, "content"),
                                                add_special_tokens=add_special)
    if not with_pieces:
        return {"tokens": tokens}
    return {"tokens": [{"id": token, "piece": tokenizer.wrapper.decode([token])} for token in tokens]}


async def _vllm_tokens(request: web.Request, tokenizer: ModelTokenizer, body: TokenizeRequest) -> list[int]:
    """A prompt as it is, or messages through the chat template as /v1/chat/completions renders them."""
    if body.prompt is not None:
        if body.messages is not None:
            raise ApiError(400, "send prompt or messages, not both", param="messages")
        text = checked_length(body.prompt, "prompt")
        special = True if body.add_special_tokens is None else body.add_special_tokens
    else:
        if body.continue_final_message and body.add_generation_prompt:
            raise ApiError(400, "continue_final_message needs add_generation_prompt set to false",
                           param="continue_final_message")
        chat = ChatRequest(model=ModelId(""), messages=body.messages or [], tools=body.tools,
                           chat_template_kwargs=body.chat_template_kwargs)
        params = countable(to_params(chat, ImageUploads(context_of(request).settings)))
        text = checked_length(await asyncio.to_thread(
            render_prompt, tokenizer.wrapper, template_messages(params), params.tools, params.enable_thinking,
            body.add_generation_prompt, body.continue_final_message), "messages")
        special = bool(body.add_special_tokens)
    tokens: list[int] = await asyncio.to_thread(tokenizer.wrapper.encode, text, add_special_tokens=special)
    return tokens
