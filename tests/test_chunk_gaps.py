"""Text never goes missing silently (exo/api/generation.py): chunks a live listener did not get
(a NATS reconnect drops plain messages) are taken from the EXO_TOKENS stream, in order; chunks
that JetStream does not hold either end the generation with an error, never with a clean finish."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from types import SimpleNamespace

import msgspec

from exo.api.generation import Generation
from exo.api.metrics import Metrics
from exo.bus.publish import publish_durably
from exo.bus.subjects import TOKENS_STREAM, token_subject
from exo.bus.token_stream import TokenListener
from exo.core.events import TaskFinished
from exo.core.requests import TokenChunk
from exo.core.state import State
from exo.settings.services import ApiSettings


def chunks_of(command_id: str, texts: list[str]) -> list[TokenChunk]:
    body = [TokenChunk(command_id=command_id, index=i, text=t, token_count=i + 1) for i, t in enumerate(texts)]
    return [*body, TokenChunk(command_id=command_id, index=len(texts), token_count=len(texts), finish_reason="length")]


async def stored(nc, chunks: list[TokenChunk]) -> None:
    for chunk in chunks:
        await publish_durably(nc, token_subject(chunk.command_id), msgspec.json.encode(chunk), TOKENS_STREAM,
                              f"{chunk.command_id}:{chunk.index}")


async def received(nc, command_id: str, delivered: list[TokenChunk], ended: TaskFinished | None = None,
                   listener: TokenListener | None = None) -> list[TokenChunk]:
    """What a Generation yields when its live listener got only `delivered` (or what `listener` gets)."""
    cancels: list[str] = []
    ctx = SimpleNamespace(nc=nc, metrics=Metrics(), readers=Counter(), view=SimpleNamespace(state=State()),
                          settings=ApiSettings(),
                          in_background=lambda coroutine: (coroutine.close(), cancels.append(command_id)))
    listener = listener or TokenListener()
    for chunk in delivered:
        listener.queue.put_nowait(chunk)
    end = asyncio.get_running_loop().create_future()
    if ended is not None:
        end.set_result(ended)
    generation = Generation(ctx, command_id, listener, end)
    out = [chunk async for chunk in generation.chunks()]
    # A generation missing text, or sent text it cannot read, is cancelled, not left running.
    assert bool(cancels) == ("were lost" in out[-1].error or "could not be decoded" in out[-1].error)
    return out


async def test_missing_chunks_come_from_jetstream_in_order(nc):
    command_id = uuid.uuid4().hex
    chunks = chunks_of(command_id, ["The ", "sea ", "is ", "deep ", "and ", "wide."])
    await stored(nc, chunks)
    delivered = [chunks[0], chunks[3], chunks[3], chunks[5], chunks[6]]  # 1, 2 and 4 lost, 3 twice
    out = await received(nc, command_id, delivered)
    assert [c.index for c in out] == [0, 1, 2, 3, 4, 5, 6]
    assert "".join(c.text for c in out) == "The sea is deep and wide." and out[-1].finish_reason == "length"


async def test_chunks_jetstream_never_got_end_the_generation_with_an_error(nc):
    command_id = uuid.uuid4().hex
    chunks = chunks_of(command_id, ["a", "b", "c", "d"])
    await stored(nc, [c for c in chunks if c.index != 2])  # chunk 2 was lost before it was stored
    out = await received(nc, command_id, [chunks[0], chunks[3], chunks[4]])
    assert [c.index for c in out] == [0, 1, 3]
    assert out[-1].finish_reason == "error" and "1 chunks of this generation's text were lost" in out[-1].error


async def test_a_last_chunk_that_did_not_arrive_is_read_from_jetstream(nc):
    command_id = uuid.uuid4().hex
    chunks = chunks_of(command_id, ["x", "y"])
    await stored(nc, chunks)
    ended = TaskFinished(task_id=command_id, status="completed", finish_reason="length", completion_tokens=2)
    out = await received(nc, command_id, [chunks[0]], ended)
    assert [(c.index, c.text, c.finish_reason) for c in out] == [(0, "x", None), (1, "y", None), (2, "", "length")]


async def test_an_end_from_the_worker_after_the_runners_chunks_ends_at_once(nc):
    # A runner that died mid-generation: the worker ends its task with a chunk of index 0.
    command_id = uuid.uuid4().hex
    chunks = chunks_of(command_id, ["a", "b"])[:2]
    await stored(nc, chunks)
    ended_by_worker = TokenChunk(command_id=command_id, index=0, finish_reason="error", error="the runner failed")
    out = await asyncio.wait_for(received(nc, command_id, [*chunks, ended_by_worker]), 10)  # not a duplicate to wait past
    assert [(c.index, c.finish_reason) for c in out] == [(0, None), (1, None), (0, "error")]


async def test_a_chunk_that_arrives_but_does_not_decode_ends_the_generation_saying_so_not_as_lost(nc, caplog):
    command_id = uuid.uuid4().hex
    good = chunks_of(command_id, ["a", "b"])
    # A logprob of null (what msgspec writes for -inf) where the chunk's type holds a float.
    undecodable = msgspec.json.encode({"command_id": command_id, "index": 1, "text": "b", "token_count": 2,
                                       "logprobs": [{"token": "b", "logprob": None}]})
    listener = await TokenListener.live(nc, command_id)
    subject = token_subject(command_id)
    for index, data in enumerate([msgspec.json.encode(good[0]), undecodable, msgspec.json.encode(good[2])]):
        await publish_durably(nc, subject, data, TOKENS_STREAM, f"{command_id}:{index}")  # stored and delivered live
    out = await asyncio.wait_for(received(nc, command_id, [], listener=listener), 10)
    await listener.close()
    assert [(c.index, c.text, c.finish_reason) for c in out] == [(0, "a", None), (1, "", "error")]
    assert out[-1].error.startswith("chunk 1 of this generation's text could not be decoded (Expected `float`, got "
                                    "`null` - at `$.logprobs[0].logprob`)")
    assert f"a token chunk on {subject} does not decode" in caplog.text
