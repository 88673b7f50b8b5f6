"""Models shared inside the cluster: a node serves the verified files of the models it has to
other nodes, over core NATS request/reply, so a cluster fetches a model from the Hub once.

`exo.models.<node id>.manifest` answers a model's manifest (its files' sizes and sha256, and
which are verified on that node); `exo.models.<node id>.chunk` answers up to `length` bytes of
one verified file from `offset`. A fetching node keeps a window of chunk requests in flight
and checks the whole file against the manifest's sha256 before using it, so a bad peer costs
a retry from the Hub, never a corrupt model. Nothing is stored in JetStream: the data plane
stays out of the streams.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from exo.bus.errors import BusError
from exo.bus.peers.responders import Responders
from exo.bus.subjects import model_share_subject
from exo.core.ids import ModelId, NodeId
from exo.core.manifest import Manifest, decode_manifest, encode_manifest

log = logging.getLogger(__name__)

MAX_CHUNK = 2 << 20  # bytes per reply; below the server's max_payload (see `chunk_size`)
WINDOW = 4  # chunk requests in flight per file...
IN_FLIGHT = 8  # ...and per fetching node (see fetch_from_peer): 16 MB at most
_ERROR_HEADER = "Exo-Error"

# model id -> (model directory, manifest) of a model this node can serve, or None.
Lookup = Callable[[ModelId], Awaitable[tuple[Path, Manifest] | None]]


class ShareRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Strict (unknown fields refused) and bounded where it enters: a negative length used to
    mean "the rest of the file", read whole into memory."""

    model_id: ModelId
    path: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    offset: Annotated[int, msgspec.Meta(ge=0)] = 0
    length: Annotated[int, msgspec.Meta(ge=0, le=MAX_CHUNK)] = 0


class PeerError(BusError):
    """A peer could not give us a model's file; the caller falls back to another source."""


_request_decoder = msgspec.json.Decoder(ShareRequest)


def chunk_size(nc: Client) -> int:
    return max(64 << 10, min(MAX_CHUNK, nc.max_payload - 4096))


def _read(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as file:
        file.seek(offset)
        return file.read(length)


class ModelShareServer:
    def __init__(self, nc: Client, node_id: NodeId, lookup: Lookup) -> None:
        self._nc = nc
        self._node_id = node_id
        self._lookup = lookup
        self._responders = Responders(nc)

    async def start(self) -> None:
        await self._responders.start({model_share_subject(self._node_id, "manifest"): self._on_manifest,
                                      model_share_subject(self._node_id, "chunk"): self._on_chunk})

    async def stop(self) -> None:
        await self._responders.stop()

    async def _error(self, msg: Msg, reason: str) -> None:
        await self._nc.publish(msg.reply, b"", headers={_ERROR_HEADER: reason})

    async def _on_manifest(self, msg: Msg) -> None:
        try:
            request = _request_decoder.decode(msg.data)
        except msgspec.MsgspecError as error:
            await self._error(msg, f"bad request: {error}")
            return
        found = await self._lookup(request.model_id)
        if found is None:
            await self._error(msg, f"{request.model_id} is not on node {self._node_id}")
            return
        await self._nc.publish(msg.reply, encode_manifest(found[1]))

    async def _on_chunk(self, msg: Msg) -> None:
        try:
            request = _request_decoder.decode(msg.data)
        except msgspec.MsgspecError as error:
            await self._error(msg, f"bad request: {error}")
            return
        found = await self._lookup(request.model_id)
        # Only files this node verified, named exactly as in its manifest: no path tricks.
        if found is None or request.path not in found[1].verified:
            await self._error(msg, f"{request.model_id}/{request.path} is not on node {self._node_id}")
            return
        length = min(request.length, chunk_size(self._nc))
        try:
            data = await asyncio.to_thread(_read, found[0] / request.path, request.offset, length)
        except OSError as error:
            await self._error(msg, f"cannot read {request.path}: {error.strerror}")
            return
        await self._nc.publish(msg.reply, data)


async def _request(nc: Client, subject: str, request: ShareRequest, timeout: float) -> bytes:
    try:
        reply = await nc.request(subject, msgspec.json.encode(request), timeout=timeout)
    except (TimeoutError, NatsError) as error:
        raise PeerError(f"no answer on {subject}: {type(error).__name__}") from None
    if reply.headers and _ERROR_HEADER in reply.headers:
        raise PeerError(reply.headers[_ERROR_HEADER])
    return reply.data


async def peer_manifest(nc: Client, peer: NodeId, model_id: ModelId, timeout: float = 5.0) -> Manifest:
    data = await _request(nc, model_share_subject(peer, "manifest"), ShareRequest(model_id=model_id), timeout)
    try:
        return decode_manifest(data)
    except msgspec.MsgspecError as error:
        raise PeerError(f"node {peer} sent an unreadable manifest: {error}") from None


async def fetch_from_peer(
    nc: Client, peer: NodeId, model_id: ModelId, path: str, start: int, size: int,
    write: Callable[[bytes], Awaitable[None]], slots: asyncio.Semaphore, window: int = WINDOW, timeout: float = 30.0,
) -> None:
    """Bytes [start, size) of one file, handed to `write` in order.

    `slots` bounds the chunks in flight across every file this node fetches: replies that
    outrun the reader pile up in the client and the server, and past nats-server's per-client
    limit (64 MB) it cuts the whole connection as a slow consumer. A file waits for a slot only
    while it has nothing in flight, so files holding slots always drain them (no deadlock).
    """
    subject = model_share_subject(peer, "chunk")
    step = chunk_size(nc)
    offsets = deque(range(start, size, step))
    in_flight: deque[tuple[int, asyncio.Task[bytes]]] = deque()

    async def fill() -> None:
        while offsets and len(in_flight) < window and not (in_flight and slots.locked()):
            await slots.acquire()
            offset = offsets.popleft()
            request = ShareRequest(model_id=model_id, path=path, offset=offset, length=min(step, size - offset))
            in_flight.append((offset, asyncio.ensure_future(_request(nc, subject, request, timeout))))

    try:
        await fill()
        while in_flight:
            offset, reply = in_flight[0]
            data = await reply
            in_flight.popleft()
            slots.release()
            expected = min(step, size - offset)
            if len(data) != expected:
                raise PeerError(f"node {peer} sent {len(data)} bytes of {path} at {offset}, expected {expected}")
            await fill()
            await write(data)
    finally:
        for _, pending in in_flight:
            pending.cancel()
            slots.release()
