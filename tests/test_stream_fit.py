"""Streams fitted to a JetStream with less room than streams/*.json ask share the room alike: every
one is made smaller by the same power of two, the smallest with which they all fit, rather than the
first taking their file's size and the last what is left. The room is JetStream's own limit
(max_file_store), so this needs no small disk mounted (tests/test_small_disk.py has the real one)."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from exo.bus.connection import connect
from exo.bus.provision import provision, stream_configs
from exo.bus.server.embedded import nats_server_binary
from exo.bus.stream_fit import FITTED_TO_DISK, MIN_STREAM_BYTES
from tests.support.exo_process import free_port

# JetStream's file store: the 22 GiB the files ask fit only a quarter of it; taken first come, first
# served, the first streams would keep their size and the last get an eighth.
ROOM = 31 << 28  # 7.75 GiB


@pytest_asyncio.fixture
async def small_jetstream(tmp_path: Path) -> AsyncIterator[str]:
    port = free_port()
    config = tmp_path / "nats-server.conf"
    config.write_text(f'jetstream {{ store_dir: "{tmp_path / "store"}", max_file_store: {ROOM} }}\n')
    server = subprocess.Popen([nats_server_binary(), "--config", str(config), "--addr", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"nats://127.0.0.1:{port}"
    try:
        for _ in range(200):  # until it listens
            assert server.poll() is None, f"nats-server exited with code {server.returncode}"
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        yield url
    finally:
        server.terminate()
        server.wait(10)


async def test_streams_that_do_not_fit_are_all_shrunk_by_one_power_of_two(small_jetstream: str):
    nc = await connect([small_jetstream], name="t")
    try:
        await provision(nc)
        js = nc.jetstream()
        bounded = {c["name"]: c["max_bytes"] for c in stream_configs() if c.get("max_bytes", -1) > 0}
        made = {name: (await js.stream_info(name)).config for name in bounded}
    finally:
        await nc.close()
    divisor = 1
    while sum(bounded.values()) // divisor > ROOM:  # the smallest power of two with which all fit
        divisor *= 2
    assert divisor == 4 and all(size // divisor >= MIN_STREAM_BYTES for size in bounded.values())
    assert {name: config.max_bytes for name, config in made.items()} == {name: size // divisor for name, size in bounded.items()}
    assert {name: (config.metadata or {}).get(FITTED_TO_DISK) for name, config in made.items()} == {
        name: str(size) for name, size in bounded.items()}
