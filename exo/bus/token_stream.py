"""The data plane: generated text on exo.tokens.<command_id>, captured by the EXO_TOKENS stream.

Runners publish with exo/bus/token_publisher.py (every chunk acked, resent if not); here: a
single last chunk from a worker (its runner died), and reading chunks back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api

from exo.bus.chunk_gate import ChunkGate
from exo.bus.chunk_signing import ChunkSigner
from exo.bus.inbound import from_clients_only
from exo.bus.jetstream_api import jetstream_request
from exo.bus.publish import publish_durably
from exo.bus.subjects import TOKENS_STREAM, token_subject
from exo.core.ids import CommandId
from exo.core.requests import TokenChunk
from exo.telemetry import tracing

log = logging.getLogger(__name__)

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(TokenChunk)


class UndecodableChunk(TokenChunk, frozen=True, kw_only=True):
    """Stands for a chunk that arrived but does not decode: it ends its generation with an error that
    says so (a chunk that never arrived is another error: text lost in transit)."""


class _ChunkPlace(msgspec.Struct):
    """What an undecodable chunk still says of its place in the generation, if its JSON reads at all."""

    index: int = -1
    attempt: int = 0


_place_decoder = msgspec.json.Decoder(_ChunkPlace)


def decoded_chunk(msg: Msg, command_id: CommandId) -> TokenChunk:
    try:
        return _decoder.decode(msg.data)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        log.error("a token chunk on %s does not decode: %s", msg.subject, error)
        try:
            place = _place_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            place = _ChunkPlace()
        where = f"chunk {place.index}" if place.index >= 0 else "a chunk"
        return UndecodableChunk(command_id=command_id, index=place.index, attempt=place.attempt, finish_reason="error",
                                error=f"{where} of this generation's text could not be decoded ({error}); "
                                      "the runner sent what the API cannot read")


async def publish_chunk(nc: Client, chunk: TokenChunk, signer: ChunkSigner | None = None) -> None:
    subject, payload = token_subject(chunk.command_id), _encoder.encode(chunk)
    signed = signer.headers(subject, payload) if signer is not None else {}
    if chunk.finish_reason is None:
        await nc.publish(subject, payload, headers=signed or None)
    else:
        msg_id = f"{chunk.command_id}:{chunk.index}:{chunk.finish_reason}"
        await publish_durably(nc, subject, payload, TOKENS_STREAM, msg_id, headers=signed)


async def stored_chunks(nc: Client, command_id: CommandId, first: int, stop: int | None,
                        timeout: float = 5.0, gate: ChunkGate | None = None) -> dict[int, TokenChunk]:
    """The chunks of one generation that EXO_TOKENS holds, by index: `first` to `stop` (excluded),
    or with `stop` None everything from `first` through the last chunk. For a listener that
    missed some (its connection dropped); what is not there after `timeout` was never stored
    (a runner resends a chunk JetStream did not ack after 1 s: the timeout leaves room for that)."""
    listener = await TokenListener.from_stream(nc, command_id, gate=gate)
    found: dict[int, TokenChunk] = {}
    end = stop
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while end is None or any(i not in found for i in range(first, end)):
            chunk = await listener.next_within(deadline - loop.time())
            if chunk is None:
                break
            held = found.get(chunk.index)
            if chunk.index >= first and (stop is None or chunk.index < stop) and (
                    held is None or chunk.attempt >= held.attempt):  # a later run's chunk replaces an earlier's
                found[chunk.index] = chunk
                if stop is None and chunk.finish_reason is not None:
                    end = chunk.index + 1
    finally:
        await listener.close()
    return found


async def resume_point(nc: Client, command_id: CommandId, attempt: int, timeout: float = 5.0,
                       gate: ChunkGate | None = None) -> tuple[list[int], int]:
    """For run `attempt` of a generation taking over from the runs before it: the token ids they
    streamed, in order, and the index of the next chunk. Their stored chunks, each run's from the
    index it resumed at, up to the first gap (what JetStream never stored is generated again).
    With a `gate`, only chunks signed by their run's node count (a forged one is a gap)."""
    last = await jetstream_request(nc, f"$JS.API.STREAM.MSG.GET.{TOKENS_STREAM}",
                                   {"last_by_subj": token_subject(command_id)})
    if last.get("error"):
        return [], 0  # nothing stored: it starts from the beginning
    last_seq = int(last["message"]["seq"])
    listener = await TokenListener.from_stream(nc, command_id, with_sequence=True, gate=gate)
    chunks: list[TokenChunk] = []
    try:
        while (found := await listener.next_with_sequence(timeout)) is not None:
            seq, chunk = found
            if chunk.attempt < attempt and chunk.finish_reason is None:
                chunks.append(chunk)
            if seq >= last_seq:
                break
    finally:
        await listener.close()
    return chain_of(chunks)


def chain_of(chunks: list[TokenChunk]) -> tuple[list[int], int]:
    """The token ids of one generation's chunks as its runs sent them (each run's chunks from its
    first index on replace the runs before it), up to the first missing index; and that index."""
    by_index: dict[int, TokenChunk] = {}
    for chunk in chunks:
        held = by_index.get(chunk.index)
        if held is None or chunk.attempt >= held.attempt:
            by_index[chunk.index] = chunk
    starts = {c.attempt: min(i for i, k in by_index.items() if k.attempt == c.attempt) for c in by_index.values()}
    token_ids: list[int] = []
    index = 0
    while (next_chunk := by_index.get(index)) is not None and not any(
            a > next_chunk.attempt and start <= index for a, start in starts.items()):
        token_ids += next_chunk.token_ids
        index += 1
    return token_ids, index


class TokenListener:
    """Every chunk of one generation, in order, from its first.

    `live()` subscribes on the plain subject before the command is sent (no round trip, and
    nothing can be published before the command exists); `from_stream()` replays from
    JetStream for a listener that arrives late. With a `gate`, only chunks it admits arrive
    (exo/bus/chunk_gate.py: signed by the node running their run).
    """

    def __init__(self, command_id: CommandId = CommandId(""), gate: ChunkGate | None = None) -> None:
        self.command_id = command_id
        self.gate = gate
        self.queue: asyncio.Queue[TokenChunk] = asyncio.Queue()
        self._sequenced: asyncio.Queue[tuple[int, TokenChunk]] = asyncio.Queue()  # (stream sequence, chunk)
        self._subscription: Subscription | None = None
        self._receiving: dict[int, tracing.OpenSpan] = {}  # run (attempt) -> its chunks' span here, when traced

    @classmethod
    async def live(cls, nc: Client, command_id: CommandId, gate: ChunkGate | None = None) -> TokenListener:
        listener = cls(command_id, gate)
        # A runner's publish, never a JetStream delivery: a push consumer aimed at this subject
        # could otherwise put stored chunks of another generation into this one.
        listener._subscription = await nc.subscribe(token_subject(command_id), cb=from_clients_only(listener._on_msg))
        return listener

    @classmethod
    async def from_stream(cls, nc: Client, command_id: CommandId, with_sequence: bool = False,
                          gate: ChunkGate | None = None) -> TokenListener:
        listener = cls(command_id, gate)
        listener._subscription = await nc.jetstream().subscribe(
            token_subject(command_id),
            stream=TOKENS_STREAM,
            ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.ALL,
            cb=listener._on_stored if with_sequence else listener._on_msg,
        )
        return listener

    async def next_with_sequence(self, seconds: float) -> tuple[int, TokenChunk] | None:
        try:
            return await asyncio.wait_for(self._sequenced.get(), seconds)
        except TimeoutError:
            return None

    async def _admits(self, msg: Msg) -> bool:
        # Awaited in the subscription's callback: later chunks wait behind this one, so order holds.
        return self.gate is None or await self.gate.admits(self.command_id, msg.subject, msg.data, msg.headers)

    async def _on_stored(self, msg: Msg) -> None:
        if not await self._admits(msg):
            return
        self._sequenced.put_nowait((msg.metadata.sequence.stream, decoded_chunk(msg, self.command_id)))

    async def next_within(self, seconds: float) -> TokenChunk | None:
        try:
            return await asyncio.wait_for(self.queue.get(), seconds)
        except TimeoutError:
            return None

    async def _on_msg(self, msg: Msg) -> None:
        if not await self._admits(msg):
            return
        chunk = decoded_chunk(msg, self.command_id)
        if (traceparent := tracing.traceparent_of(msg.headers)) and chunk.attempt not in self._receiving:
            self._receiving[chunk.attempt] = tracing.start_span("exo.tokens.receive", traceparent, "consumer",
                                                                {"exo.attempt": chunk.attempt})
        self.queue.put_nowait(chunk)

    async def close(self) -> None:
        for receiving in self._receiving.values():  # from each run's first chunk here until the reading ends
            receiving.end()
        self._receiving.clear()
        if self._subscription is not None:
            with contextlib.suppress(Exception):  # already closed with its connection
                await self._subscription.unsubscribe()
            self._subscription = None
