"""A runner's token chunks into EXO_TOKENS, every one acknowledged by JetStream.

Waiting for each ack before the next chunk would cost a round trip per token, so chunks go out
back to back, each with a reply subject of its own on one inbox subscription, and the ack comes
back when it comes. A chunk not acknowledged within RESEND_AFTER_S (a reconnect lost it, the
server restarted) is sent again, oldest first, with the same Nats-Msg-Id: the stream's duplicate
window turns a chunk that had landed into a no-op. The last chunk of a generation returns only
once it and every chunk before it are stored. A chunk still unacknowledged after GIVE_UP_S is
logged and dropped: the API then finds the gap and ends the response with an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from exo.bus.chunk_signing import ChunkSigner
from exo.bus.inbound import from_clients_only
from exo.bus.subjects import token_subject
from exo.core.requests import TokenChunk
from exo.telemetry.tracing import with_traceparent

log = logging.getLogger(__name__)

RESEND_AFTER_S = 1.0
GIVE_UP_S = 30.0  # well inside EXO_TOKENS' 60 s duplicate window: a resend never writes twice
MAX_UNACKED = 1024  # past this, publishing waits for acks (NATS is away: hold no more in memory)

_encoder = msgspec.json.Encoder()


def chunk_msg_id(chunk: TokenChunk) -> str:
    end = f":{chunk.finish_reason}" if chunk.finish_reason else ""
    # A migrated task's later runs (attempt > 0) send indices an earlier run may have sent too:
    # neither may be taken for a duplicate of the other.
    run = f":a{chunk.attempt}" if chunk.attempt else ""
    return f"{chunk.command_id}{run}:{chunk.index}{end}"


@dataclass
class _Unacked:
    subject: str
    payload: bytes
    msg_id: str
    first_sent: float
    last_sent: float
    traceparent: str = ""  # the runner's publishing span of a traced request (exo/telemetry)
    signed: dict[str, str] | None = None  # its signature headers (exo/bus/chunk_signing.py), signed once


class ChunkPublisher:
    def __init__(self, nc: Client, signer: ChunkSigner | None = None) -> None:
        self._nc = nc
        self._signer = signer  # the node's key: the API node admits only chunks its run's node signed
        self._unacked: dict[int, _Unacked] = {}  # by our sequence, in sending order
        self._sent = 0
        self._prefix = ""
        self._changed = asyncio.Event()
        self._resender: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._prefix = self._nc.new_inbox()
        await self._nc.subscribe(f"{self._prefix}.*", cb=from_clients_only(self._on_ack))  # acks come from the server
        self._resender = asyncio.create_task(self._resend_forever(), name="chunk resender")

    async def publish(self, chunk: TokenChunk, traceparent: str = "") -> None:
        """Send one chunk; for a generation's last, wait until every chunk so far is stored."""
        while len(self._unacked) >= MAX_UNACKED:
            await self._wait_for_change(RESEND_AFTER_S)
        self._sent += 1
        now = asyncio.get_running_loop().time()
        subject, payload = token_subject(chunk.command_id), _encoder.encode(chunk)
        signed = self._signer.headers(subject, payload) if self._signer is not None else None
        entry = _Unacked(subject, payload, chunk_msg_id(chunk), now, now, traceparent, signed)
        self._unacked[self._sent] = entry
        await self._send(self._sent, entry)
        if chunk.finish_reason is not None:
            await self._wait_stored(self._sent, GIVE_UP_S)

    async def close(self) -> None:
        if self._resender is not None:
            self._resender.cancel()

    async def _send(self, seq: int, entry: _Unacked) -> None:
        try:
            await self._nc.publish(entry.subject, entry.payload, reply=f"{self._prefix}.{seq}",
                                   headers=with_traceparent({**(entry.signed or {}), "Nats-Msg-Id": entry.msg_id},
                                                            entry.traceparent))
        except Exception as error:  # reconnecting, buffer full: the resender tries again
            log.info("token chunk %s not sent (%r); will resend", entry.msg_id, error)

    async def _on_ack(self, msg: Msg) -> None:
        try:
            seq = int(msg.subject.rsplit(".", 1)[1])
            ack = json.loads(msg.data)
        except ValueError:
            return
        if "error" in ack:  # e.g. the stream's leader is changing: resent later
            log.info("token chunk not stored: %s", ack["error"].get("description"))
            return
        if self._unacked.pop(seq, None) is not None:
            self._changed.set()

    async def _wait_stored(self, upto: int, timeout: float) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while any(seq <= upto for seq in self._unacked):
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return  # the resender gives up on them and says so
            await self._wait_for_change(min(left, RESEND_AFTER_S))

    async def _wait_for_change(self, timeout: float) -> None:
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    async def _resend_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(RESEND_AFTER_S / 4)
            now = loop.time()
            for seq, entry in list(self._unacked.items()):  # oldest first
                if now - entry.first_sent > GIVE_UP_S:
                    log.error("token chunk %s not stored by JetStream after %.0f s; dropped", entry.msg_id, GIVE_UP_S)
                    del self._unacked[seq]
                    self._changed.set()
                elif now - entry.last_sent > RESEND_AFTER_S and seq in self._unacked:
                    entry.last_sent = now
                    await self._send(seq, entry)
