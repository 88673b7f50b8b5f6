"""A spoofed mDNS announcement is a hint, never a membership: a fake peer announcing a ready
cluster with a route to a dead port used to make a new node write that cluster into its data
dir, exit after 120 s, and "rejoin" it at every later start until someone deleted the file.
Now the node saves a cluster only once it is a working member of it; a join that does not take
falls back to deciding again without that cluster."""

from __future__ import annotations

import asyncio
import socket
import uuid
from pathlib import Path

import pytest

from exo.bus.server.cluster_formation import Announcement
from exo.bus.server.cluster_node import ClusterNode, DiscoverySettings
from exo.bus.server.discovery import Discovery
from exo.bus.server.membership import load_membership

pytestmark = pytest.mark.slow  # starts JetStream cluster servers


def _dead_port() -> int:
    with socket.socket() as probe:  # bound, never listening: a route there is refused at once
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def _start(store: Path, settings: DiscoverySettings) -> ClusterNode:
    node = ClusterNode(store, "node-a", 0, settings)
    try:
        await asyncio.wait_for(node.start(), 90)
    except BaseException:
        node.kill()  # no server outlives a failed start
        raise
    return node


async def test_a_fake_ready_cluster_is_tried_then_dropped_and_never_saved(tmp_path: Path, caplog):
    namespace, secret_id = f"test-{uuid.uuid4().hex[:8]}", f"test-{uuid.uuid4().hex[:8]}"
    settings = DiscoverySettings(address="127.0.0.1", secret="s", secret_id=secret_id, namespace=namespace,
                                 browse_s=0.5, join_timeout_s=3.0)
    spoofer = Discovery(["127.0.0.1"])
    await spoofer.start(Announcement(node_id="bogus", namespace=namespace, secret_id=secret_id, state="ready",
                                     cluster="exo-bogus", host="127.0.0.1", cluster_port=_dead_port()))
    store = tmp_path / "a" / "nats"
    try:
        node = await _start(store, settings)
        try:
            assert "could not join cluster exo-bogus" in caplog.text
            membership = load_membership(store)
            assert membership is not None and (membership.cluster, membership.seeded) == ("exo-node-a", True)
        finally:
            await node.stop()
        again = await _start(store, settings)  # a restart, the spoofer still there: its own cluster again
        try:
            assert again.membership is not None and again.membership.cluster == "exo-node-a"
        finally:
            await again.stop()
    finally:
        await spoofer.stop()
