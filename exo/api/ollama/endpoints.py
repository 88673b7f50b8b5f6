"""Ollama's API: /api/chat and /api/generate (NDJSON streams, the default, and not; `images` as
bare base64), /api/tags, /api/show, /api/ps, /api/version. Errors are Ollama's {"error": "..."}
(see errors.py)."""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from exo.api.auth import current_grant
from exo.api.availability import NOWHERE, availability
from exo.api.collect import collect
from exo.api.context import context_of
from exo.api.errors import ApiError
from exo.api.generation import Generation, generating
from exo.api.images import USER_ONLY, ImageUploads
from exo.api.keep_alive import keep_alive_seconds
from exo.api.ollama.wire import ChatRequest, GenerateRequest, ModelRequest, OllamaMessage, Options
from exo.api.request_body import decode_body
from exo.api.structured import ollama_format
from exo.api.thinking import from_ollama
from exo.api.tool_conversation import Conversation, arguments_object, arguments_text, offered_tools
from exo.api.validate import OLLAMA_REPEAT_LAST_N, REPEAT_LAST_N_MAX, at_least_one, check_repetition_penalty, in_range, stop_list
from exo.core.ids import InstanceId, ModelId
from exo.core.requests import ChatMessage, EmbedInputs, GenerationParams, TokenChunk, ToolCall
from exo.core.state import State
from exo.core.types import ModelCard

OLLAMA_VERSION = "0.9.0"  # the Ollama API level these routes follow


def _params(options: Options | None, **fields: Any) -> GenerationParams:
    o = options or Options()
    num_predict = None if o.num_predict is None or o.num_predict < 0 else at_least_one(o.num_predict, "num_predict")
    return GenerationParams(
        **fields, max_tokens=num_predict, temperature=in_range(o.temperature, 0.0, 2.0, "temperature"),
        top_p=in_range(o.top_p, 0.0, 1.0, "top_p"), top_k=at_least_one(o.top_k, "top_k"), seed=o.seed,
        stop=stop_list(o.stop), presence_penalty=in_range(o.presence_penalty, -2.0, 2.0, "presence_penalty"),
        frequency_penalty=in_range(o.frequency_penalty, -2.0, 2.0, "frequency_penalty"),
        min_p=in_range(o.min_p, 0.0, 1.0, "min_p"), **_repetition(o),
    )


def _repetition(o: Options) -> dict[str, Any]:
    """repeat_penalty over the last repeat_last_n tokens, as Ollama: only when it is asked for
    (Ollama's own default of 1.1 is left out, so a plain request stays mlx-lm's greedy text)."""
    window = in_range(o.repeat_last_n, -1, REPEAT_LAST_N_MAX, "repeat_last_n")
    penalty = check_repetition_penalty(o.repeat_penalty, "repeat_penalty")
    return {"repetition_penalty": None if window == 0 else penalty,
            "repetition_context_size": OLLAMA_REPEAT_LAST_N if window is None else window}


def _unsupported(**given: object) -> None:
    for name, value in given.items():
        if value:
            raise ApiError(400, f"{name} is not supported by this server")


async def chat(request: web.Request) -> web.StreamResponse:
    body = await decode_body(request, ChatRequest)
    if not body.messages:
        raise ApiError(400, "messages must contain at least one message")
    roles = {"system", "user", "assistant", "tool"}
    if bad := [m.role for m in body.messages if m.role not in roles]:
        raise ApiError(400, f"invalid role {bad[0]!r}: use one of {sorted(roles)}")
    uploads = ImageUploads(context_of(request).settings)
    conversation = _conversation(body.messages, uploads)
    params = _params(body.options, messages=conversation.messages, tool_turns=conversation.tool_turns,
                     tools=offered_tools(body.tools, None), enable_thinking=from_ollama(body.think),
                     response_format=ollama_format(body.format))
    return await _run(request, body.model, params, body.stream, _chat_piece, uploads, keep_alive_seconds(body.keep_alive))


def _conversation(messages: list[OllamaMessage], uploads: ImageUploads) -> Conversation:
    """Ollama's calls carry no ids: each gets one, and a tool message answers the first call
    still unanswered (of its tool_name, when it says)."""
    conversation = Conversation()
    unanswered: list[ToolCall] = []
    for n, message in enumerate(messages):
        if message.images and message.role != "user":
            raise ApiError(400, f"messages[{n}]: {USER_ONLY}, not in a {message.role} one")
        if message.role == "assistant" and message.tool_calls:
            unanswered = [ToolCall(id=f"call_{n}_{k}", name=c.function.name,
                                   arguments=arguments_text(c.function.arguments, f"messages[{n}].tool_calls[{k}].arguments"))
                          for k, c in enumerate(message.tool_calls)]
            conversation.call(message.content, unanswered)
        elif message.role == "tool":
            match = next((c for c in unanswered if not message.tool_name or c.name == message.tool_name), None)
            if match is not None:
                unanswered.remove(match)
            conversation.answer(match.id if match else f"call_{n}", message.content,
                                message.tool_name or (match.name if match else ""))
        else:
            conversation.say(message.role, message.content, _images(message.images, f"messages[{n}].images", uploads))
    return conversation


def _images(images: list[str] | None, param: str, uploads: ImageUploads) -> list[str]:
    return [uploads.add_base64(image, f"{param}[{k}]") for k, image in enumerate(images or [])]


async def generate(request: web.Request) -> web.StreamResponse:
    body = await decode_body(request, GenerateRequest)
    keep_alive_s = keep_alive_seconds(body.keep_alive)
    if not body.prompt and not body.images:  # Ollama's way to load a model, or with keep_alive 0 to unload it
        return await _load_or_unload(request, body.model, keep_alive_s)
    _unsupported(suffix=body.suffix)
    uploads = ImageUploads(context_of(request).settings)
    if body.raw:
        if body.images:  # a raw prompt is the model's text as it is: nothing in it can stand for an image
            raise ApiError(400, "images cannot be sent with raw: true; send them with a templated prompt")
        params = _params(body.options, prompt=body.prompt, response_format=ollama_format(body.format))
    else:
        system = [ChatMessage(role="system", content=body.system)] if body.system else []
        user = ChatMessage(role="user", content=body.prompt, images=_images(body.images, "images", uploads))
        params = _params(body.options, messages=[*system, user],
                         enable_thinking=from_ollama(body.think), response_format=ollama_format(body.format))
    return await _run(request, body.model, params, body.stream, _generate_piece, uploads, keep_alive_s)


async def _load_or_unload(request: web.Request, model: ModelId, keep_alive_s: float | None) -> web.Response:
    """A request with nothing to generate loads its model and answers once it is loaded; with
    keep_alive 0 it unloads it (once no request uses it). Both go the way a request does, as one
    token the answer drops: the master places a model on demand, and takes a keep_alive, only for
    a request; a model not loaded is not placed only to be unloaded."""
    ctx = context_of(request)
    unload = keep_alive_s == 0
    state = ctx.view.state
    card = ctx.card(model)
    if unload and card is not None and not any(d.model_id == model for d in state.desires.values()):
        return web.json_response(_head(model) | {"response": "", "done": True, "done_reason": "unload"})
    params = GenerationParams(embed=EmbedInputs(texts=["load"], query="load" if card.embedding.rerank else None)) \
        if card is not None and card.embedding is not None \
        else GenerationParams(messages=[ChatMessage(role="user", content="")], max_tokens=1)
    async with generating(ctx, model, params, ApiError(404, f"model '{model}' not found"),
                          keep_alive_s=keep_alive_s) as generation:
        await collect(generation)
    return web.json_response(_head(model) | {"response": "", "done": True, "done_reason": "unload" if unload else "load"})


# A surface's message for a piece of the answer: /api/generate's and /api/chat's differ.
Piece = Callable[[str, str, list[ToolCall] | None], dict[str, Any]]


def _generate_piece(text: str, reasoning: str = "", calls: list[ToolCall] | None = None) -> dict[str, Any]:
    return {"response": text, "thinking": reasoning} if reasoning else {"response": text}


def _chat_piece(text: str, reasoning: str = "", calls: list[ToolCall] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning:
        message["thinking"] = reasoning
    if calls:
        message["tool_calls"] = [{"function": {"name": c.name, "arguments": arguments_object(c.arguments)}} for c in calls]
    return {"message": message}


async def _run(request: web.Request, model: ModelId, params: GenerationParams, stream: bool, piece: Piece,
               uploads: ImageUploads, keep_alive_s: float | None) -> web.StreamResponse:
    started = time.perf_counter_ns()
    ctx = context_of(request)
    async with generating(ctx, model, params, ApiError(404, f"model '{model}' not found"),
                          storing=uploads.stored(ctx, model, "images"), keep_alive_s=keep_alive_s) as generation:
        if stream:
            return await _stream(request, generation, model, piece, started)
        done = await collect(generation)
        assert done.final is not None
        return web.json_response(_head(model) | piece(done.text, done.reasoning, done.tool_calls) | _done(done.final, started))


def _head(model: str) -> dict[str, Any]:
    return {"model": model, "created_at": datetime.now(UTC).isoformat().replace("+00:00", "Z")}


def _done(final: TokenChunk, started_ns: int) -> dict[str, Any]:
    total = time.perf_counter_ns() - started_ns
    return {"done": True, "done_reason": "length" if final.finish_reason == "length" else "stop",
            "total_duration": total, "load_duration": 0, "prompt_eval_count": final.prompt_tokens,
            "prompt_eval_duration": 0, "eval_count": final.token_count, "eval_duration": total}


async def _stream(request: web.Request, generation: Generation, model: str, piece: Piece, started: int) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)

    async def send(obj: dict[str, Any]) -> None:
        await response.write(json.dumps(obj, ensure_ascii=False).encode() + b"\n")

    async def still_loading(note: str) -> None:
        # Ollama's NDJSON has no comments: a line with no text keeps the client from timing out.
        await send(_head(model) | piece("", "", None) | {"done": False})

    generation.tell_loading(still_loading)
    async for chunk in generation.chunks():
        if chunk.text or chunk.reasoning or chunk.tool_calls:
            await send(_head(model) | piece(chunk.text, chunk.reasoning, chunk.tool_calls) | {"done": False})
        if chunk.finish_reason in ("error", "cancelled"):
            await send({"error": chunk.error or "generation was cancelled"})
        elif chunk.finish_reason:
            await send(_head(model) | piece("", "", None) | _done(chunk, started))
    await response.write_eof()
    return response


def _model_entry(card: ModelCard) -> dict[str, Any]:
    digest = hashlib.sha256(f"{card.model_id}@{card.revision}".encode()).hexdigest()
    return {"name": card.model_id, "model": card.model_id, "modified_at": "1970-01-01T00:00:00Z",
            "size": card.storage_bytes, "digest": digest, "details": _details(card)}


def _details(card: ModelCard) -> dict[str, Any]:
    return {"parent_model": "", "format": "mlx", "family": "", "families": None, "parameter_size": "",
            "quantization_level": ""}


async def tags(request: web.Request) -> web.Response:
    """Every card the caller's key may use (clients pick from this list), each with the nodes it is
    ready or downloaded on."""
    ctx = context_of(request)
    where = availability(ctx.view.state)
    grant = current_grant.get()
    cards = sorted((c for c in ctx.all_cards().values() if grant.may_use(c.model_id)), key=lambda c: c.model_id)
    return web.json_response({"models": [_model_entry(c) | where.get(c.model_id, NOWHERE).fields() for c in cards]})


async def show(request: web.Request) -> web.Response:
    body = await decode_body(request, ModelRequest)
    model_id = body.model or ModelId(body.name)
    card = context_of(request).card(model_id)
    if card is None or not current_grant.get().may_use(model_id):  # out of the key's scope: as if unknown
        raise ApiError(404, f"model '{model_id}' not found")
    info = {"general.architecture": "", "general.context_length": card.context_length,
            "general.block_count": card.n_layers, "general.embedding_length": card.hidden_size}
    return web.json_response({"modelfile": "", "parameters": "", "template": "", "license": "",
                              "details": _details(card), "model_info": info, "capabilities": ["completion"],
                              "modified_at": "1970-01-01T00:00:00Z"})


async def ps(request: web.Request) -> web.Response:
    ctx = context_of(request)
    grant = current_grant.get()
    running = sorted({i.model_id for i in ctx.view.state.instances.values() if grant.may_use(i.model_id)})
    held = _memory_held(ctx.view.state)
    now = time.time()
    models = [_model_entry(card) | {"expires_at": _expires_at(ctx.view.state, model_id, now), "size": held[model_id],
                                    "size_vram": held[model_id], "context_length": card.context_length}
              for model_id in running if (card := ctx.card(model_id)) is not None]
    return web.json_response({"models": models})


NEVER_EXPIRES = "2999-01-01T00:00:00Z"  # a model kept until deleted (Ollama shows a far-future time too)


def _expires_at(state: State, model_id: ModelId, now: float) -> str:
    """When the master unloads the model if no request comes (exo/master/supervise.py idle_desires):
    its desire's last use plus its keep_alive, counted from now while a request uses or waits for
    it; with several desires, the last of them."""
    open_tasks = state.open_tasks_by_instance()
    waited_for = any(t.model_id == model_id for t in open_tasks.get(InstanceId(""), []))
    latest = 0.0
    for instance in state.instances_of(model_id):
        desire = state.desires.get(instance.desire_id)
        if desire is None or desire.keep_alive_s < 0 or not desire.last_used_at:
            return NEVER_EXPIRES
        busy = waited_for or any(open_tasks.get(i.instance_id) for i in state.instances_of_desire(desire.desire_id))
        latest = max(latest, (now if busy else desire.last_used_at) + desire.keep_alive_s)
    return datetime.fromtimestamp(latest, UTC).isoformat().replace("+00:00", "Z")


def _memory_held(state: State) -> Counter[ModelId]:
    """Per model, what its instances take on their nodes: each shard's weights and KV cache
    reservation, summed over every instance (Ollama's `size`, all of it in unified or GPU memory)."""
    held: Counter[ModelId] = Counter()
    for instance in state.instances.values():
        held[instance.model_id] += sum(s.memory_bytes + s.kv_bytes for s in instance.shards)
    return held


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": OLLAMA_VERSION})
