"""The master's sweep of exo-adapters (exo/master/adapter_sweep.py): weights no adapter in State
names are deleted once older than the grace; named ones stay, a deleting adapter's included, and
so does an unnamed upload younger than the grace (its AddAdapter may be on its way)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
from nats.aio.client import Client

from exo.bus.adapters import store_adapter, stored_adapter_weights
from exo.bus.connection import connect
from exo.bus.provision import provision
from exo.core.adapters import Adapter
from exo.core.events import AdapterAdded, AdapterDeleting
from exo.master.adapter_sweep import sweep_once
from exo.master.adapters import orphan_weights
from tests.support import as_master
from tests.support.cluster import NatsServer, start_node, wait_until

BASE = "org/tiny"
T = TypeVar("T")


def adapter(name: str, digest: str) -> Adapter:
    return Adapter(name=name, base_model=BASE, digest=digest, size=1, config="{}")


def test_only_unnamed_weights_older_than_the_grace_are_orphans():
    state = as_master.fold([AdapterAdded(adapter=adapter("pirate", "a" * 64)), AdapterAdded(adapter=adapter("old", "c" * 64)),
                            AdapterDeleting(name="old")])
    stored = {"a" * 64: 0.0, "b" * 64: 100.0, "c" * 64: 0.0, "d" * 64: 950.0, "e" * 64: 10.0}
    assert orphan_weights(state, stored, now=1000.0, grace_s=60.0) == ["b" * 64, "e" * 64]
    assert orphan_weights(state, stored, now=1000.0, grace_s=0.0) == ["b" * 64, "d" * 64, "e" * 64]
    assert orphan_weights(state, {}, now=1000.0, grace_s=0.0) == []


async def test_a_sweep_deletes_the_unnamed_weights_and_keeps_the_named(fresh_nats):
    nc = await connect([fresh_nats], name="test-sweep")
    try:
        await provision(nc)
        assert await stored_adapter_weights(nc) == {}  # an empty bucket lists as nothing
        named, orphan = b"named weights", b"orphaned weights"
        for data in (named, orphan):
            await store_adapter(nc, data)
        digest_named, digest_orphan = (hashlib.sha256(d).hexdigest() for d in (named, orphan))
        state = as_master.fold([AdapterAdded(adapter=adapter("kept", digest_named))])
        assert await sweep_once(nc, lambda: state, grace_s=3600.0) == []  # both younger than an hour
        assert set(await stored_adapter_weights(nc)) == {digest_named, digest_orphan}
        assert await sweep_once(nc, lambda: state, grace_s=0.0) == [digest_orphan]
        assert set(await stored_adapter_weights(nc)) == {digest_named}
        assert await sweep_once(nc, lambda: state, grace_s=0.0) == []  # nothing left to do
    finally:
        await nc.close()


async def on_bus(url: str, action: Callable[[Client], Awaitable[T]]) -> T:
    nc = await connect([url], name="test-sweep")
    try:
        return await action(nc)
    finally:
        await nc.close()


@pytest.mark.slow
def test_the_leading_master_sweeps_weights_left_behind(tmp_path):
    """Weights stored with no adapter ever added for them (an API node that stopped between the
    upload and the command, or a deletion whose API node stopped first) leave within a sweep."""
    nats = NatsServer(tmp_path / "nats")
    node = start_node(tmp_path, "node", nats.url, "--no-worker",
                      env={"EXO_ADAPTER_SWEEP_S": "1", "EXO_ADAPTER_SWEEP_GRACE_S": "0"})
    try:
        digest, _ = asyncio.run(on_bus(nats.url, lambda nc: store_adapter(nc, b"weights nobody named")))
        wait_until(lambda: digest not in asyncio.run(on_bus(nats.url, stored_adapter_weights)), 30, 0.5,
                   "the orphaned weights swept")
        assert "deleted the weights of 1 adapters no longer in State" in node.output()
    finally:
        node.interrupt()
        nats.stop()
