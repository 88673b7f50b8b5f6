"""Joining a cluster by a member's address (`--join HOST:PORT`), where mDNS cannot find it: other
subnets, containers, a LAN that drops multicast.

The address is the member's cluster (route) port. Its server says the cluster's name in the INFO
line it sends every new connection, before any password: that name is what a route must carry to
be let in, so the joiner learns it there and needs nothing else than the cluster's secret. From
there the join is discovery's: a route to the member, then the same wait for the meta group
(exo/bus/server/cluster_node.py).
"""

from __future__ import annotations

import asyncio
import json

from exo.bus.errors import BusError
from exo.bus.server.cluster_formation import Join
from exo.bus.server.server_config import route_url

RETRY_S = 0.5
_INFO_LIMIT = 64 * 1024


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def cluster_name_of(info_line: bytes, address: str) -> str:
    """The cluster's name from a server's INFO line; a BusError that says what `address` is instead."""
    verb, _, body = info_line.decode(errors="replace").strip().partition(" ")
    try:
        info = json.loads(body) if verb == "INFO" else None
    except ValueError:
        info = None
    if not isinstance(info, dict):
        raise BusError(f"--join {address}: not a NATS server (it said {info_line[:60]!r})")
    if "client_id" in info:
        raise BusError(f"--join {address}: this is a NATS client port; --join takes a member's cluster port, the one "
                       "its start banner names (\"another node joins it with --join HOST:PORT\")")
    name = info.get("cluster")
    if not isinstance(name, str) or not name:
        raise BusError(f"--join {address}: this NATS server is not in a cluster")
    return name


async def _info_line(host: str, port: int) -> bytes:
    reader, writer = await asyncio.open_connection(host, port, limit=_INFO_LIMIT)
    try:
        return await reader.readline()
    finally:
        writer.close()


async def join_role(address: str, timeout: float) -> Join:
    """The cluster to join at `address`, waiting up to `timeout` s for it to answer (it may be starting)."""
    host, port = split_address(address)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            line = await asyncio.wait_for(_info_line(host, port), RETRY_S * 4)
            return Join(cluster=cluster_name_of(line, address), routes=[route_url(host, port)])
        except (OSError, TimeoutError) as error:
            if loop.time() >= deadline:
                raise BusError(f"--join {address}: no cluster port answers there within {timeout:g} s ({error!r}); "
                               "give the address a member's start banner names") from None
        await asyncio.sleep(RETRY_S)
