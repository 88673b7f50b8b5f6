"""Prefill on one instance, decode on another: the runner-to-runner part.

A decode runner (the asker) connects over TCP to a prefill runner (the server) and asks for the KV
cache of one task's prompt; the cache itself travels as kv_transfer.py sends it. Anyone can
connect to the port, so both sides prove who they are with their node keys (chunk_signing.py),
over a nonce the server picks for this connection, so nothing signed can be replayed:

    server: b"EXPF" | nonce (32 bytes)
    asker:  b"EXPA" | length (4 bytes, big-endian) | msgpack PrefillAsk, signed over nonce + the
            ask's msgpack with an empty signature (subject "exo.prefill.ask")
    server: b"EXNO" | length | utf-8 reason, then closes; or
            b"EXOK" | the cache (kv_transfer.send_cache) | length | base64 signature over
            nonce + sha256 of the cache's bytes (subject "exo.prefill.cache")

The server serves only tasks it was told to expect (`PrefillServer.expect`), each once, to the
node named there; everything it reads is bounded in size and time.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import cast

import msgspec

from exo.bus.chunk_signing import SIGNATURE_HEADER, ChunkSigner, signature_valid
from exo.core.ids import ModelId, TaskId
from exo.runner.kv_transfer import Encoded, receive_frames, send_cache
from exo.runner.kv_wire import CacheHeader, Count, TransferLimits, TransferRefused

log = logging.getLogger(__name__)

GREETING, ASK, ACCEPTED, REFUSED = b"EXPF", b"EXPA", b"EXOK", b"EXNO"
ASK_SUBJECT, CACHE_SUBJECT = "exo.prefill.ask", "exo.prefill.cache"
NONCE_BYTES = 32
MAX_ASK_BYTES = 8 << 20
MAX_REASON_BYTES = 1024
MAX_SIGNATURE_BYTES = 256  # base64 of an ed25519 signature is 88
MAX_EXPECTED = 1000

Prefill = Callable[[TaskId, list[int]], Awaitable[Encoded]]


class PrefillRefused(Exception):
    """No cache came: the message names why (the server's own reason, where it gave one)."""


class PrefillAsk(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    task_id: TaskId
    model_id: ModelId
    tokens: list[Count]  # the whole prompt
    asker: str  # the asking node's id
    signature: str  # base64 ed25519 by the asker's node key; see sign_ask


_ask_decoder = msgspec.msgpack.Decoder(PrefillAsk)


def _ask_bytes(nonce: bytes, ask: PrefillAsk) -> bytes:
    return nonce + msgspec.msgpack.encode(msgspec.structs.replace(ask, signature=""))


def sign_ask(ask: PrefillAsk, nonce: bytes, signer: ChunkSigner) -> PrefillAsk:
    """`ask`, signed by `signer` for the connection whose greeting carried `nonce`."""
    signature = signer.headers(ASK_SUBJECT, _ask_bytes(nonce, ask))[SIGNATURE_HEADER]
    return msgspec.structs.replace(ask, signature=signature)


def encode_ask(ask: PrefillAsk) -> bytes:
    body = msgspec.msgpack.encode(ask)
    return ASK + len(body).to_bytes(4, "big") + body


def _printable(data: bytes) -> str:
    """A peer's text, safe to show and log: control characters cannot forge log lines."""
    text = data[:MAX_REASON_BYTES].decode("utf-8", errors="replace")
    return "".join(c if c.isprintable() else "?" for c in text)


def _framed(magic: bytes, payload: bytes) -> bytes:
    return magic + len(payload).to_bytes(4, "big") + payload


@dataclass(frozen=True)
class _Expected:
    asker: str
    public_key: str
    deadline: float


class _HashingWriter:
    """What send_cache writes goes to the socket and into a sha256; a peer that stops reading
    gets `timeout_s` per drain, not forever."""

    def __init__(self, writer: asyncio.StreamWriter, timeout_s: float) -> None:
        self._writer, self._timeout_s = writer, timeout_s
        self.sha256 = hashlib.sha256()

    def write(self, data: bytes | memoryview) -> None:
        self.sha256.update(data)
        self._writer.write(data)

    async def drain(self) -> None:
        await asyncio.wait_for(self._writer.drain(), self._timeout_s)


class _HashingReader:
    """What receive_frames reads (with readexactly, all it uses), hashed as it is read."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self.sha256 = hashlib.sha256()

    async def readexactly(self, n: int) -> bytes:
        data = await self._reader.readexactly(n)
        self.sha256.update(data)
        return data


class PrefillServer:
    """Serves prefills of `model_id` to the decode runners it is told to expect."""

    def __init__(self, model_id: ModelId, prefill: Prefill, signer: ChunkSigner, *, max_tokens: int,
                 vocab_size: int = 0, clock: Callable[[], float] = time.monotonic, read_timeout_s: float = 10.0,
                 max_connections: int = 4, announce_grace_s: float = 10.0) -> None:
        self.model_id, self._prefill, self._signer = model_id, prefill, signer
        self._max_tokens, self._vocab_size, self._clock = max_tokens, vocab_size, clock
        self._read_timeout_s, self._max_connections = read_timeout_s, max_connections
        self._expected: OrderedDict[TaskId, _Expected] = OrderedDict()
        self._served: OrderedDict[TaskId, None] = OrderedDict()  # for a clearer refusal of a second ask
        self._connections = 0
        self._server: asyncio.Server | None = None
        # An ask may come before its announcement: both follow the same event, on different nodes.
        self._announce_grace_s = announce_grace_s
        self._awaited: dict[TaskId, asyncio.Event] = {}  # asks waiting for their announcement (one per connection)

    def expect(self, task_id: TaskId, asker_node: str, asker_public_key: str, deadline: float) -> None:
        """Serve `task_id` once to `asker_node` (signing with `asker_public_key`) until `deadline` (on `clock`)."""
        self._served.pop(task_id, None)
        self._expected[task_id] = _Expected(asker_node, asker_public_key, deadline)
        self._expected.move_to_end(task_id)
        while len(self._expected) > MAX_EXPECTED:
            self._expected.popitem(last=False)
        if (announced := self._awaited.get(task_id)) is not None:
            announced.set()

    async def start(self, host: str = "0.0.0.0", port: int = 0) -> int:
        self._server = await asyncio.start_server(self._handle, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(writer.get_extra_info("peername"))
        try:
            if self._connections >= self._max_connections:  # refused at once: waiting ones would pile up
                await self._refuse(writer, peer, f"busy: {self._connections} prefill connections open")
                return
            self._connections += 1
            try:
                await self._serve(reader, writer, peer)
            finally:
                self._connections -= 1
        except (OSError, EOFError) as error:  # TimeoutError is an OSError: a peer that stopped reading
            log.warning("prefill connection from %s lost: %r", peer, error)
        finally:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        nonce = secrets.token_bytes(NONCE_BYTES)
        writer.write(GREETING + nonce)
        try:
            ask = await asyncio.wait_for(_read_ask(reader), self._read_timeout_s)
            await self._announcement(ask.task_id)
            self._admit(ask, nonce)
        except TimeoutError:
            return await self._refuse(writer, peer, f"no complete ask within {self._read_timeout_s} s")
        except asyncio.IncompleteReadError:
            return await self._refuse(writer, peer, "the connection closed before a complete ask")
        except PrefillRefused as refused:
            return await self._refuse(writer, peer, str(refused))
        try:
            encoded = await self._prefill(ask.task_id, ask.tokens)
        except Exception as error:  # the asker learns why, rather than a closed connection
            return await self._refuse(writer, peer, f"the prefill of task {ask.task_id} failed: {error}")
        writer.write(ACCEPTED)
        hashing = _HashingWriter(writer, self._read_timeout_s)
        await send_cache(cast(asyncio.StreamWriter, hashing), encoded)  # send_cache only writes and drains
        signature = self._signer.headers(CACHE_SUBJECT, nonce + hashing.sha256.digest())[SIGNATURE_HEADER]
        writer.write(_framed(b"", signature.encode()))
        await hashing.drain()

    async def _announcement(self, task_id: TaskId) -> None:
        """Until `task_id` is expected (or served), at most `announce_grace_s`: then _admit says why not."""
        if task_id in self._expected or task_id in self._served or task_id in self._awaited:
            return
        self._awaited[task_id] = announced = asyncio.Event()
        try:
            await asyncio.wait_for(announced.wait(), self._announce_grace_s)
        except TimeoutError:
            pass
        finally:
            del self._awaited[task_id]

    def _admit(self, ask: PrefillAsk, nonce: bytes) -> None:
        """PrefillRefused naming the first reason not to serve `ask`; else it is served, this once."""
        now = self._clock()
        for task_id in [t for t, e in self._expected.items() if e.deadline < now]:
            del self._expected[task_id]
        if ask.task_id in self._served:
            raise PrefillRefused(f"task {ask.task_id} was served already")
        expected = self._expected.get(ask.task_id)
        if expected is None:
            raise PrefillRefused(f"task {ask.task_id} is not expected here (never announced, or past its deadline)")
        if ask.asker != expected.asker:
            raise PrefillRefused(f"task {ask.task_id} is expected from node {expected.asker}, not {ask.asker}")
        if not signature_valid(expected.public_key, ASK_SUBJECT, _ask_bytes(nonce, ask), ask.signature):
            raise PrefillRefused(f"the ask's signature is not node {expected.asker}'s")
        self._check_prompt(ask)
        del self._expected[ask.task_id]
        self._served[ask.task_id] = None
        while len(self._served) > MAX_EXPECTED:
            self._served.popitem(last=False)

    def _check_prompt(self, ask: PrefillAsk) -> None:
        if ask.model_id != self.model_id:
            raise PrefillRefused(f"this server prefills model {self.model_id!r}, not {ask.model_id!r}")
        if not 1 <= len(ask.tokens) <= self._max_tokens:
            raise PrefillRefused(f"a prompt of {len(ask.tokens)} tokens; this server prefills 1 to {self._max_tokens}")
        if self._vocab_size and (bad := [t for t in ask.tokens if t >= self._vocab_size]):
            raise PrefillRefused(f"token id {bad[0]} is outside this model's vocabulary ({self._vocab_size})")

    async def _refuse(self, writer: asyncio.StreamWriter, peer: str, reason: str) -> None:
        log.warning("refused a prefill ask from %s: %s", peer, _printable(reason.encode()))
        writer.write(_framed(REFUSED, reason.encode()[:MAX_REASON_BYTES]))
        await asyncio.wait_for(writer.drain(), self._read_timeout_s)


async def _read_ask(reader: asyncio.StreamReader) -> PrefillAsk:
    start = await reader.readexactly(len(ASK) + 4)
    if start[: len(ASK)] != ASK:
        raise PrefillRefused(f"not a prefill ask (it starts with {start[:len(ASK)]!r})")
    length = int.from_bytes(start[len(ASK):], "big")
    if length > MAX_ASK_BYTES:
        raise PrefillRefused(f"the ask is {length} bytes, more than the {MAX_ASK_BYTES} allowed")
    try:
        return _ask_decoder.decode(await reader.readexactly(length))
    except msgspec.DecodeError as error:
        raise PrefillRefused(f"not a prefill ask: {error}") from None


async def ask_prefill(host: str, port: int, *, task_id: TaskId, model_id: ModelId, tokens: list[int],
                      signer: ChunkSigner, server_public_key: str, limits: TransferLimits,
                      timeout_s: float) -> tuple[CacheHeader, list[bytes]]:
    """The checked header and arrays' bytes of the cache of `tokens` but the last, prefilled by the
    server at host:port (signing with `server_public_key`); PrefillRefused naming the cause if not."""
    ask = PrefillAsk(task_id=task_id, model_id=model_id, tokens=tokens, asker=signer.node_id, signature="")
    try:
        return await asyncio.wait_for(_connect_and_ask(host, port, ask, signer, server_public_key, limits), timeout_s)
    except TimeoutError:
        raise PrefillRefused(f"no complete answer from the prefill server {host}:{port} within {timeout_s} s") from None
    except asyncio.IncompleteReadError as error:
        raise PrefillRefused(f"the prefill server {host}:{port} closed the connection: {len(error.partial)} of "
                             f"{error.expected} bytes came") from None
    except OSError as error:
        raise PrefillRefused(f"the connection to the prefill server {host}:{port} failed: {error}") from None


async def _connect_and_ask(host: str, port: int, ask: PrefillAsk, signer: ChunkSigner, server_public_key: str,
                           limits: TransferLimits) -> tuple[CacheHeader, list[bytes]]:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        return await _exchange(reader, writer, ask, signer, server_public_key, limits)
    finally:
        writer.close()


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ask: PrefillAsk, signer: ChunkSigner,
                    server_public_key: str, limits: TransferLimits) -> tuple[CacheHeader, list[bytes]]:
    await _expect_magic(reader, GREETING, "a prefill server's greeting")
    nonce = await reader.readexactly(NONCE_BYTES)
    writer.write(encode_ask(sign_ask(ask, nonce, signer)))
    await writer.drain()
    await _expect_magic(reader, ACCEPTED, "an answer to the ask")
    hashing = _HashingReader(reader)
    try:
        header, payloads = await receive_frames(cast(asyncio.StreamReader, hashing), limits)  # it only readexactly's
    except TransferRefused as refused:
        raise PrefillRefused(f"the cache was refused: {refused}") from None
    length = int.from_bytes(await reader.readexactly(4), "big")
    if length > MAX_SIGNATURE_BYTES:
        raise PrefillRefused(f"the cache's signature is {length} bytes, more than {MAX_SIGNATURE_BYTES}")
    signature = (await reader.readexactly(length)).decode("ascii", errors="replace")
    if not signature_valid(server_public_key, CACHE_SUBJECT, nonce + hashing.sha256.digest(), signature):
        raise PrefillRefused("the cache's signature is not the prefill server's (another key, or bytes changed on the way)")
    _check_header(header, ask)
    return header, payloads


async def _expect_magic(reader: asyncio.StreamReader, magic: bytes, what: str) -> None:
    """Reads `magic`; PrefillRefused with the server's reason if it refused, or naming what came instead."""
    start = await reader.readexactly(len(magic))
    if start == REFUSED:
        length = int.from_bytes(await reader.readexactly(4), "big")
        reason = await reader.readexactly(min(length, MAX_REASON_BYTES))
        raise PrefillRefused(f"the prefill server refused: {_printable(reason)}")
    if start != magic:
        raise PrefillRefused(f"not {what} (it starts with {start!r})")


def _check_header(header: CacheHeader, ask: PrefillAsk) -> None:
    """The signed cache is the one asked for: this task, this model, this prompt's length and last token."""
    if (header.task_id, header.model_id) != (ask.task_id, ask.model_id):
        raise PrefillRefused(f"the cache is of task {header.task_id} of model {header.model_id!r}; "
                             f"task {ask.task_id} of model {ask.model_id!r} was asked for")
    if header.pending_tokens != ask.tokens[-1:] or header.cached_tokens != len(ask.tokens) - 1:
        raise PrefillRefused(f"the cache holds {header.cached_tokens} tokens with {header.pending_tokens} pending; "
                             f"the prompt has {len(ask.tokens)} tokens ending in {ask.tokens[-1:]}")
