"""SSE framing as the official clients decode it: a comment (a model still loading, a keep-alive)
between events that carry an `id:` must not reach openai-python or anthropic as an event of its own
(one with empty data, which their `json.loads` fails on: a CI run's batching test did)."""

from __future__ import annotations

from typing import Any, cast

import pytest
from aiohttp import web
from anthropic._streaming import SSEDecoder as AnthropicDecoder
from openai._streaming import SSEDecoder as OpenAIDecoder

from exo.api.sse import SseStream


class _Written:
    """What a StreamResponse would put on the wire: the bytes SseStream writes, in order."""

    def __init__(self) -> None:
        self.wire = b""

    async def write(self, data: bytes) -> None:
        self.wire += data


async def _a_stream_told_it_is_loading() -> bytes:
    written = _Written()
    sse = SseStream(cast(web.StreamResponse, written))
    await sse.send({"n": 0}, event_id="c:-1")  # the role chunk, before the first token
    await sse.comment("loading org/m on node-a")
    await sse.comment("keep-alive")
    await sse.send({"n": 1}, event_id="c:0")
    await sse.send("[DONE]")
    return written.wire


@pytest.mark.parametrize("decoder", [OpenAIDecoder, AnthropicDecoder], ids=["openai", "anthropic"])
async def test_comments_between_events_with_ids_are_no_events(decoder: Any):
    wire = await _a_stream_told_it_is_loading()
    events = list(decoder().iter_bytes(iter([wire])))
    assert [e.data for e in events] == ['{"n":0}', '{"n":1}', "[DONE]"]
    assert [e.id for e in events] == ["c:-1", "c:0", "c:0"]  # the spec keeps the last id


async def test_comments_stay_comments_to_a_spec_reader():
    wire = await _a_stream_told_it_is_loading()
    assert b"\n: loading org/m on node-a\n: keep-alive\nid: c:0\n" in wire
