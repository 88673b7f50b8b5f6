"""Chat completion answers in OpenAI's shapes: whole, streamed, and streams resumed.

Every streamed event carries `id: <command_id>:<chunk index>`. A client that lost its
connection sends the last id back (`Last-Event-ID`, on a POST to /v1/chat/completions or a
GET of /v1/chat/completions/{id}/stream) or asks for `?after=N`, and gets the rest of the same
generation: the text is in JetStream, so nothing is generated twice.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from exo.api.choices import collect_choices, newly_ended
from exo.api.collect import Collected
from exo.api.context import context_of
from exo.api.errors import ApiError
from exo.api.generation import Generation, resume_generation
from exo.api.sse import SseStream
from exo.core.ids import CommandId
from exo.core.requests import TokenChunk, TokenLogprob, ToolCall

ID_PREFIX = "chatcmpl-"


def envelope(command_id: CommandId, model: str, kind: str) -> dict[str, Any]:
    return {"id": f"{ID_PREFIX}{command_id}", "object": kind, "created": int(time.time()), "model": model,
            "system_fingerprint": None}


def usage(final: TokenChunk) -> dict[str, Any]:
    """OpenAI's usage; cached_tokens: prompt tokens the runner's prompt cache already held."""
    prompt, completion = final.prompt_tokens, final.token_count
    shown = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": final.cached_tokens}}
    if final.draft_tokens:  # speculative decoding: what the draft proposed and the model kept (OpenAI's name)
        shown["completion_tokens_details"] = {"accepted_prediction_tokens": final.draft_tokens}
    return shown


async def complete_chat(generation: Generation, model: str, with_logprobs: bool) -> web.Response:
    choices = await collect_choices(generation)
    final = choices[0].final
    assert final is not None
    body = envelope(generation.command_id, model, "chat.completion") | {
        "choices": [_choice_json(index, done, with_logprobs) for index, done in enumerate(choices)], "usage": usage(final)}
    return web.json_response(body)


def _choice_json(index: int, done: Collected, with_logprobs: bool) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": done.text if done.text or not done.tool_calls else None,
                               "refusal": None}
    if done.reasoning:
        message["reasoning_content"] = done.reasoning
    if done.tool_calls:
        message["tool_calls"] = tool_calls_json(done.tool_calls)
    return {"index": index, "message": message, "finish_reason": done.finish_reason,
            "logprobs": logprobs_json(done.logprobs) if with_logprobs else None}


async def stream_chat(request: web.Request, generation: Generation, model: str, include_usage: bool,
                      with_logprobs: bool, resumed: bool = False, n: int = 1) -> web.StreamResponse:
    """With n > 1, each event carries one choice's delta (`choices[0].index` says which, as OpenAI streams them)."""
    sse = await SseStream.open(request)
    generation.tell_loading(sse.comment)
    base = envelope(generation.command_id, model, "chat.completion.chunk")

    def choice(delta: dict[str, Any], finish_reason: str | None = None, logprobs: dict[str, Any] | None = None,
               index: int = 0) -> dict[str, Any]:
        return base | {"choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]}

    if not resumed:
        for index in range(n):
            await sse.send(choice({"role": "assistant", "content": ""}, index=index), event_id=f"{generation.command_id}:-1")
    calls_sent: dict[int, int] = {}  # by choice
    ended: set[int] = set()  # choices whose finish chunk was sent
    async for chunk in generation.chunks():
        # A chunk's events are held and written together: one write per chunk, and the last
        # chunk's events go out with [DONE] and the end of the body (SseStream.close).
        event_id = f"{generation.command_id}:{chunk.index}"
        delta = _delta(chunk, calls_sent.get(chunk.choice, 0))
        calls_sent[chunk.choice] = calls_sent.get(chunk.choice, 0) + len(chunk.tool_calls)
        if delta or (with_logprobs and chunk.logprobs):
            await sse.send(choice(delta, None, logprobs_json(chunk.logprobs) if with_logprobs else None, chunk.choice),
                           event_id=event_id, hold=True)
        if chunk.finish_reason in ("error", "cancelled"):
            message = chunk.error or "generation was cancelled"
            kind = "invalid_request_error" if chunk.error_code else "internal_error"
            await sse.send({"error": {"message": message, "type": kind, "code": chunk.error_code or chunk.finish_reason}},
                           event_id=event_id, hold=True)
            continue
        for index, finished in newly_ended(chunk, ended):  # each choice's at its own end, as OpenAI streams n
            reason = "tool_calls" if calls_sent.get(index) and finished == "stop" else finished
            await sse.send(choice({}, reason, index=index), event_id=event_id, hold=True)
        if chunk.finish_reason and include_usage:
            await sse.send(base | {"choices": [], "usage": usage(chunk)}, event_id=event_id, hold=True)
        if chunk.finish_reason is None:
            await sse.flush()
    await sse.send("[DONE]", hold=True)
    return await sse.close()


def _delta(chunk: TokenChunk, calls_sent: int) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if chunk.reasoning:  # first: a chunk's reasoning came before its text
        delta["reasoning_content"] = chunk.reasoning
    if chunk.text:
        delta["content"] = chunk.text
    if chunk.tool_calls:
        delta["tool_calls"] = tool_calls_json(chunk.tool_calls, first_index=calls_sent)
    return delta


def parse_event_id(value: str, command_id: CommandId | None = None) -> tuple[CommandId, int]:
    """`<command_id>:<index>` (or a bare index when the command is known) -> (command_id, index)."""
    named, _, index = value.strip().rpartition(":")
    named = named.removeprefix(ID_PREFIX)
    try:
        after = int(index)
    except ValueError:
        raise ApiError(400, f"bad event id {value!r}: expected '<id>:<chunk index>'", param="Last-Event-ID") from None
    if (named and command_id and named != command_id) or not (named or command_id):
        raise ApiError(400, f"event id {value!r} names another generation", param="Last-Event-ID")
    return CommandId(named) if named else command_id or CommandId(""), after


async def resume_chat(request: web.Request, command_id: CommandId, after: int, include_usage: bool) -> web.StreamResponse:
    ctx = context_of(request)
    generation = await resume_generation(ctx, command_id, after)
    task = ctx.view.state.tasks[command_id]
    try:
        return await stream_chat(request, generation, task.model_id, include_usage, task.params.logprobs, resumed=True,
                                 n=task.params.n)
    finally:
        await generation.close(ctx.settings.resume_grace_s)


async def resume_chat_route(request: web.Request) -> web.StreamResponse:
    """GET /v1/chat/completions/{id}/stream?after=N (or with Last-Event-ID)."""
    command_id = CommandId(request.match_info["id"].removeprefix(ID_PREFIX))
    if "Last-Event-ID" in request.headers:
        command_id, after = parse_event_id(request.headers["Last-Event-ID"], command_id)
    else:
        try:
            after = int(request.query.get("after", "-1"))
        except ValueError:
            raise ApiError(400, "after must be a chunk index (an integer)", param="after") from None
    include_usage = request.query.get("include_usage", "false").lower() in ("1", "true")
    return await resume_chat(request, command_id, after, include_usage)


def tool_calls_json(calls: list[ToolCall], first_index: int | None = None) -> list[dict[str, Any]]:
    """OpenAI's tool_calls; streamed deltas also carry each call's index."""
    out = []
    for n, call in enumerate(calls):
        entry = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        out.append(entry if first_index is None else {"index": first_index + n, **entry})
    return out


def logprobs_json(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {"content": [
        {"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode()),
         "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())} for t in e.top_logprobs]}
        for e in entries
    ], "refusal": None}
