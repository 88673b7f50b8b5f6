"""The JetStream cluster under a discovered exo cluster: who is in the meta group, how many
replicas exo's streams have, and the two changes exo makes to it by itself:
scaling every stream to three replicas once three real nodes are members, and retiring the
seed's witness once it is no longer needed for a quorum.

The meta group's view comes from the local server's monitoring endpoint (/jsz, on loopback);
changes to the meta group need the system account (exo/bus/server/server_config.py).
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import msgspec
from nats.aio.client import Client

from exo.bus.jetstream_api import jetstream_request
from exo.bus.provision import consumer_configs, group_streams, stream_configs
from exo.bus.subjects import COMMANDS_STREAM, EVENTS_STREAM, MASTER_CONSUMER
from exo.core.types import ClusterLayout, ClusterServer, StreamPlacement

log = logging.getLogger(__name__)

FULL_REPLICAS = 3
SILENT_AFTER_NS = 5_000_000_000
_API_TIMEOUT_S = 5.0


class MetaPeer(msgspec.Struct, frozen=True):
    name: str
    current: bool = False
    offline: bool = False
    active: int = 0  # ns since the leader last heard from it (idle members answer about every second)

    @property
    def online(self) -> bool:
        # nats-server 2.15 leaves `offline` unset for a killed peer: silence says it. A leader
        # elected after the peer died has never heard it (active 0); a live member answers the
        # leader about every second (seen: 0.1-0.7 s).
        return not self.offline and 0 < self.active < SILENT_AFTER_NS


class MetaGroup(msgspec.Struct, frozen=True):
    """The JetStream meta group as one server sees it."""

    name: str = ""  # the cluster's name
    leader: str = ""  # "" while no leader is known: not (yet) a working member
    cluster_size: int = 0
    replicas: list[MetaPeer] = []  # the other members, as this server sees them


class StreamReplicas(msgspec.Struct, frozen=True):
    name: str
    replicas: int
    leader: str = ""
    servers: list[str] = []  # the leader first, then the followers
    current: bool = True  # every follower caught up


async def meta_group(monitor_url: str) -> MetaGroup | None:
    """The local server's view of the meta group; None when it cannot say (yet)."""
    try:
        async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_API_TIMEOUT_S)) as session,
                    session.get(f"{monitor_url}/jsz") as response):
            body = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    meta = body.get("meta_cluster")
    return msgspec.convert(meta, MetaGroup, strict=False) if meta else None


def redundancy(event_log_replicas: int) -> str:
    """What /health and the start banner say of the event log's copies (0 replicas: unknown)."""
    if event_log_replicas != 1:
        return f"{event_log_replicas} replicas of the event log" if event_log_replicas else "unknown"
    return ("none: the event log has 1 replica, and losing its NATS server stops the cluster; fix: run three nodes "
            "as members of one exo cluster (--join HOST:PORT or discovery) instead of --nats, or a three-server "
            "NATS cluster with EXO_REPLICAS=3 (docs/deploy.md)")


async def event_log_replicas(nc: Client) -> int:
    """The replicas of the event log (EXO_EVENTS); 0 when JetStream does not say."""
    info = await jetstream_request(nc, f"$JS.API.STREAM.INFO.{EVENTS_STREAM}")
    return 0 if info.get("error") else int(info["config"].get("num_replicas", 1))


async def routed_servers(monitor_url: str) -> set[str]:
    """The names of the servers the local one has routes to (empty when it cannot say)."""
    try:
        async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_API_TIMEOUT_S)) as session,
                    session.get(f"{monitor_url}/routez") as response):
            body = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return set()
    return {route["remote_name"] for route in body.get("routes") or [] if route.get("remote_name")}


async def stream_replicas(nc: Client) -> list[StreamReplicas]:
    """exo's streams (events, commands, tokens, KV buckets, images) and where their replicas are."""
    found = []
    for name in await _exo_streams(nc):
        info = await jetstream_request(nc, f"$JS.API.STREAM.INFO.{name}")
        if info.get("error"):
            continue
        cluster = info.get("cluster") or {}
        followers = cluster.get("replicas") or []
        found.append(StreamReplicas(
            name=name, replicas=info["config"].get("num_replicas", 1), leader=cluster.get("leader", ""),
            servers=[cluster.get("leader", ""), *(f["name"] for f in followers)],
            current=all(f.get("current") for f in followers)))
    return found


async def consumers_replicated(nc: Client, replicas: int = FULL_REPLICAS) -> bool:
    """exo's durable consumers (the master's command queue) have `replicas` current copies: a
    consumer whose new replicas have not caught up has no leader if its old one dies (seen: a
    machine killed 1 s after the streams went to R3 left the master's queue without a leader)."""
    consumers = [(stream, config["durable_name"]) for stream, config in consumer_configs()]
    consumers += [(name, MASTER_CONSUMER) for name in await group_streams(nc) if name.startswith(COMMANDS_STREAM)]
    for stream, durable in consumers:
        info = await jetstream_request(nc, f"$JS.API.CONSUMER.INFO.{stream}.{durable}")
        followers = (info.get("cluster") or {}).get("replicas") or []
        if info.get("error") or len(followers) < replicas - 1 or not all(f.get("current") for f in followers):
            return False
    return True


async def scale_streams(nc: Client, replicas: int = FULL_REPLICAS) -> bool:
    """Raise every exo stream below `replicas` to it; True once all are there. A stream keeps
    its data (the new replicas catch up from the leader). Failing here (too few servers with
    the node tag yet) is normal while nodes join: the caller tries again later."""
    done = True
    for name in await _exo_streams(nc):
        info = await jetstream_request(nc, f"$JS.API.STREAM.INFO.{name}")
        if info.get("error"):
            done = False
            continue
        existing = info["config"]
        if existing.get("num_replicas", 1) >= replicas:
            continue
        reply = await jetstream_request(nc, f"$JS.API.STREAM.UPDATE.{name}", {**existing, "num_replicas": replicas})
        if reply.get("error"):
            log.info("stream %s stays at %s replicas for now: %s", name, existing.get("num_replicas", 1),
                     reply["error"].get("description"))
            done = False
        else:
            log.info("stream %s now has %d replicas", name, replicas)
    return done


async def _exo_streams(nc: Client) -> list[str]:
    """The shared streams of streams/*.json, then the master groups' (exo/core/groups.py)."""
    return [c["name"] for c in stream_configs()] + await group_streams(nc)


async def step_down_if_leader(system_nc: Client, monitor_url: str, server_name: str, timeout: float = 10.0) -> None:
    """Move meta leadership away from `server_name` (the witness, before it stops)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        meta = await meta_group(monitor_url)
        if meta is not None and meta.leader and meta.leader != server_name:
            return
        if meta is not None and meta.leader == server_name:
            await jetstream_request(system_nc, "$JS.API.META.LEADER.STEPDOWN")
        await asyncio.sleep(0.5)
    raise TimeoutError(f"meta leadership did not leave {server_name} within {timeout:g} s")


async def move_streams_off(nc: Client, server_name: str) -> bool:
    """Ask the cluster to move every exo stream's replica off `server_name` (gone for good) onto a
    spare server; True once no stream keeps one there. Without a spare a stream keeps the dead
    replica (its other two still take writes) until a node joins and this is asked again."""
    remaining = False
    for placement in await stream_replicas(nc):
        if server_name not in placement.servers:
            continue
        reply = await jetstream_request(nc, f"$JS.API.STREAM.PEER.REMOVE.{placement.name}", {"peer": server_name})
        if reply.get("error") or not reply.get("success", True):
            remaining = True
            log.info("stream %s keeps its replica on %s for now: %s", placement.name, server_name,
                     (reply.get("error") or {}).get("description", "no spare server"))
    return not remaining and all(server_name not in p.servers for p in await stream_replicas(nc))


async def remove_peer(system_nc: Client, server_name: str) -> None:
    """Take a server that is gone for good out of the meta group, so that the quorum is counted
    over the servers that remain."""
    reply = await jetstream_request(system_nc, "$JS.API.SERVER.REMOVE", {"peer": server_name})
    if reply.get("error"):
        raise RuntimeError(f"cannot remove {server_name} from the meta group: {reply['error'].get('description')}")


async def cluster_layout(nc: Client, monitor_url: str) -> ClusterLayout | None:
    """The layout as the meta leader sees it (None elsewhere: only the leader knows who is offline)."""
    meta = await meta_group(monitor_url)
    if meta is None or not meta.leader or any(peer.name == meta.leader for peer in meta.replicas):
        return None  # not the leader: the leader lists the others, never itself
    servers = [ClusterServer(name=meta.leader), *(ClusterServer(name=p.name, online=p.online) for p in meta.replicas)]
    streams = [StreamPlacement(name=s.name, replicas=s.replicas, leader=s.leader, followers=sorted(s.servers[1:]))
               for s in await stream_replicas(nc)]
    return ClusterLayout(name=meta.name, meta_leader=meta.leader, servers=sorted(servers, key=lambda s: s.name),
                         streams=streams)
