"""A runner's chunks reach EXO_TOKENS, each exactly once, across a kill -9 of the nats-server."""

from __future__ import annotations

import asyncio
import os
import signal

import msgspec
from nats.js import api

from exo.bus.connection import connect
from exo.bus.provision import provision
from exo.bus.server.embedded import EmbeddedNats
from exo.bus.subjects import TOKENS_STREAM, token_subject
from exo.bus.token_publisher import ChunkPublisher
from exo.core.requests import TokenChunk


async def _stored_indices(nc, command_id: str) -> list[int]:
    """Every stored chunk's index, in stream order, duplicates included."""
    js = nc.jetstream()
    total = (await js.stream_info(TOKENS_STREAM, subjects_filter=token_subject(command_id))).state.messages
    indices: list[int] = []
    done = asyncio.Event()

    async def on_msg(msg) -> None:
        indices.append(msgspec.json.decode(msg.data, type=TokenChunk).index)
        if len(indices) == total:
            done.set()

    subscription = await js.subscribe(token_subject(command_id), stream=TOKENS_STREAM, ordered_consumer=True,
                                      deliver_policy=api.DeliverPolicy.ALL, cb=on_msg)
    await asyncio.wait_for(done.wait(), 10)
    await subscription.unsubscribe()
    return indices


async def test_every_chunk_is_stored_exactly_once_across_server_kills(tmp_path):
    server = EmbeddedNats(tmp_path / "nats", port=0)
    nc = await connect([await server.start()], name="runner")
    await provision(nc)
    publisher = ChunkPublisher(nc)
    await publisher.start()
    try:
        for index in range(300):
            await publisher.publish(TokenChunk(command_id="gen", index=index, text=f"{index} ", token_count=index + 1))
            if index in (100, 200):  # right after a burst: some chunks are still in flight to the server
                os.kill(server.process.pid, signal.SIGKILL)
                server.process.wait()
                await server.start()  # the same port and store, as the node's supervisor does
        await asyncio.wait_for(publisher.publish(TokenChunk(command_id="gen", index=300, finish_reason="length")), 40)
        assert sorted(await _stored_indices(nc, "gen")) == list(range(301))
    finally:
        await publisher.close()
        await nc.close()
        server.stop()
