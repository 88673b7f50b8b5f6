"""One node of a discovered cluster: find the peers on the LAN, seed or join their
JetStream cluster, and keep it healthy while the node runs.

Start: announce "starting" over mDNS, listen `browse_s` (2 s), then follow
exo/bus/server/cluster_formation.py's decision. A seed runs its embedded server with a witness (a lone
server in cluster mode has no JetStream); a joiner routes to the ready members. The node says
"ready" once its server is a working member of the meta group. What it chose is kept in
`cluster.json` beside the server's store, so a restart rejoins the same cluster at once.

Running: every few seconds, once three real nodes are members, raise exo's streams to three
replicas; then the seed retires its witness (meta leadership moved away, witness stopped and
removed from the meta group), so that the quorum is counted over real nodes only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import socket
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import msgspec

from exo.bus.connection import Connection, connect
from exo.bus.errors import BusError, raise_if_cancelled
from exo.bus.server.cluster_formation import Announcement, Join, NodeState, Seed, Wait, choose_role
from exo.bus.server.discovery import Discovery, NoDiscovery
from exo.bus.server.embedded import EmbeddedNats
from exo.bus.server.jetstream_cluster import (
    FULL_REPLICAS,
    cluster_layout,
    consumers_replicated,
    meta_group,
    move_streams_off,
    remove_peer,
    routed_servers,
    scale_streams,
    step_down_if_leader,
    stream_replicas,
)
from exo.bus.server.join import join_role, split_address
from exo.bus.server.membership import MEMBERSHIP_FILE, Membership, load_membership, save_membership
from exo.bus.server.migration import has_standalone_store, migrate_standalone_store, set_aside, undo_migration
from exo.bus.server.server_config import ClusterLink, route_url
from exo.core.types import ClusterLayout
from exo.settings.services import BusSettings

log = logging.getLogger(__name__)

LayoutSink = Callable[[ClusterLayout], Awaitable[None]]  # records a layout in the log if it changed

WITNESS_DIR = "nats-witness"  # beside the node's own store
KEEP_EVERY_S = 2.0
MEMBER_WARN_EVERY_S = 30.0


class DiscoverySettings(msgspec.Struct, frozen=True, kw_only=True):
    address: str  # where mDNS and the cluster port listen (127.0.0.1 keeps it on this machine)
    secret: str  # the routes' password; the same on every node of the cluster
    secret_id: str  # a digest of it, announced: nodes with another secret are not peers
    namespace: str = "default"
    cluster_port: int = 0  # 0: any free port, then kept for restarts
    browse_s: float = 2.0  # how long a new node listens before it decides
    wait_limit_s: float = 30.0  # a peer that went first and never got ready is not waited for longer
    # A server silent this long is gone for good: its stream replicas move to a spare server and it
    # leaves the meta group, so that the quorum is counted over servers that exist. 0: never.
    remove_after_s: float = 3600.0
    # A join through announced routes that has not made this node a member by then failed: the
    # announcement was stale or spoofed, and the node decides again without that cluster.
    join_timeout_s: float = 60.0
    join: str = ""  # HOST:PORT of a member's cluster port: join its cluster there, whatever mDNS hears
    mdns: bool = True  # announce and listen on the LAN (off: --join alone finds the cluster)


def free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]  # (host, port) for AF_INET
        return port


class ClusterNode:
    def __init__(self, store_dir: Path, node_id: str, client_port: int, settings: DiscoverySettings,
                 memory_limit: str = BusSettings().nats_memory_limit, master_groups: Sequence[str] = ()) -> None:
        self.master_groups = tuple(master_groups)
        self.store_dir = store_dir
        self.memory_limit = memory_limit  # of each embedded server (EmbeddedNats)
        self.node_id = node_id
        self.client_port = client_port
        self.settings = settings
        self.server_name = f"exo-{node_id}"
        self.discovery = Discovery([settings.address]) if settings.mdns else NoDiscovery()
        self.membership: Membership | None = None
        self.server: EmbeddedNats | None = None
        self.witness: EmbeddedNats | None = None
        self._nc: Connection | None = None
        self._witness_supervisor: asyncio.Task[None] | None = None  # ends when the witness is retired
        self._silent_since: dict[str, float] = {}  # server -> when this node (as meta leader) saw it go silent
        self._online_shown = 0  # the count of online servers last logged
        self._replicated_turns = 0  # upkeep turns in a row that found everything on three current replicas
        self._distrusted: set[str] = set()  # clusters whose announced routes did not take this node in

    @property
    def witness_name(self) -> str:
        return f"{self.server_name}-witness"

    @property
    def join_address(self) -> str:
        """What another node's --join takes: where this server's cluster port listens."""
        link = self.server.cluster if self.server is not None else None
        return f"{self.settings.address}:{link.port}" if link is not None else ""

    def _me(self, state: NodeState) -> Announcement:
        member = self.membership
        return Announcement(
            node_id=self.node_id, namespace=self.settings.namespace, secret_id=self.settings.secret_id, state=state,
            cluster=member.cluster if member and state == "ready" else "", host=self.settings.address,
            cluster_port=member.port if member else 0)

    async def start(self) -> EmbeddedNats:
        """Seed or join (or rejoin) the cluster; returns this node's server once it is a member."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.membership = load_membership(self.store_dir)
        standalone = self.membership is None and has_standalone_store(self.store_dir)
        await self.discovery.start(self._me("starting"))
        if self.membership is None:
            await asyncio.sleep(self.settings.browse_s if self.settings.mdns else 0)
            await self._become_member(standalone)
        else:
            log.info("rejoining cluster %s", self.membership.cluster)
            await self._start_servers(self.membership)
            await self._until_member(timeout=None)  # its cluster may be down for a while: keep trying
        assert self.membership is not None and self.server is not None
        await self.discovery.announce(self._me("ready"))
        log.info("member of cluster %s as %s", self.membership.cluster, self.server_name)
        return self.server

    async def _become_member(self, standalone: bool) -> None:
        """Decide, start, and save the membership only once this node is a working member: an
        announcement is a hint, and a join through routes that do not answer (a dead port, a
        spoofed peer) falls back to deciding again without that cluster, never to a data dir
        that rejoins it at every start."""
        while True:
            role = await self._role()
            if standalone and isinstance(role, Join):
                raise BusError(f"{self.store_dir} holds a standalone node's log, and cluster {role.cluster} already runs "
                               "on this LAN: merging two logs is not possible. Start with --no-discovery to keep this "
                               "node standalone, or move the store away to join with an empty one")
            self.membership = self._choose(role)
            await self.discovery.announce(self._me("joining"))
            if standalone:
                set_aside(self.store_dir)
            try:
                await self._start_servers(self.membership)
                await self._until_member(self.settings.join_timeout_s if isinstance(role, Join) else 120.0)
                save_membership(self.store_dir, self.membership)
                if standalone:
                    await self._migrate()
                return
            except BaseException as error:
                if standalone:
                    await self._undo_migration()
                if self.settings.join and isinstance(error, BusError):  # asked for this cluster: no other will do
                    await self._forget_failed_join()
                    raise BusError(f"{error} (--join {self.settings.join}: is this node's cluster secret, or "
                                   "namespace in trusted-LAN mode, the same as the cluster's? A cluster with a "
                                   "secret admits a new node with a join token: `exo token create` on a member, "
                                   "then `exo join <token>` here)") from None
                if standalone or not isinstance(role, Join) or not isinstance(error, BusError):
                    raise
                log.warning("could not join cluster %s through %s (%s); not trusting its announcements, deciding again",
                            role.cluster, ", ".join(role.routes), error)
                self._distrusted.add(role.cluster)
                await self._forget_failed_join()
                await self.discovery.announce(self._me("starting"))

    async def _forget_failed_join(self) -> None:
        """Back to a fresh node: servers stopped, the cluster state its store began discarded."""
        if self._nc is not None and not self._nc.is_closed:
            await self._nc.close()
        self._nc = None
        self.kill()
        self.server = None
        self.membership = None
        shutil.rmtree(self.store_dir / "jetstream", ignore_errors=True)

    async def _role(self) -> Seed | Join:
        waited = 0.0
        while True:
            peers = [p for p in self.discovery.peers() if p.cluster not in self._distrusted]
            role = choose_role(self.node_id, self.settings.namespace, peers)
            if self.settings.join and (not isinstance(role, Wait) or waited >= self.settings.wait_limit_s):
                return await join_role(self.settings.join, self.settings.join_timeout_s)
            if not isinstance(role, Wait):
                return role
            if waited >= self.settings.wait_limit_s:
                log.warning("waited %.0f s (%s); seeding a cluster of my own", waited, role.reason)
                return Seed(cluster=f"exo-{self.node_id}")
            log.info("discovery: waiting: %s", role.reason)
            self.discovery.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.discovery.changed.wait(), 1.0)
            waited += 1.0

    def _choose(self, role: Seed | Join) -> Membership:
        host = self.settings.address
        port = self.settings.cluster_port or free_port(host)
        if isinstance(role, Seed):
            log.info("discovery: no cluster heard; seeding %s", role.cluster)
            return Membership(cluster=role.cluster, port=port, seeded=True, witness_port=free_port(host))
        how = f"--join {self.settings.join}" if self.settings.join else "discovery"
        log.info("%s: joining %s through %s", how, role.cluster, ", ".join(role.routes))
        return Membership(cluster=role.cluster, port=port, routes=role.routes)

    def _routes(self, membership: Membership) -> list[str]:
        heard = [p.route for p in self.discovery.peers() if p.state == "ready" and p.cluster == membership.cluster]
        witness = [route_url(self.settings.address, membership.witness_port)] if self._runs_witness(membership) else []
        joined = [route_url(*split_address(self.settings.join))] if self.settings.join else []
        return sorted({*membership.routes, *heard, *witness, *joined})

    def _runs_witness(self, membership: Membership) -> bool:
        return membership.seeded and not membership.witness_retired

    async def _start_servers(self, membership: Membership) -> None:
        host, secret = self.settings.address, self.settings.secret
        self.server = EmbeddedNats(self.store_dir, port=self.client_port, server_name=self.server_name, cluster=ClusterLink(
            name=membership.cluster, host=host, port=membership.port, secret=secret, routes=self._routes(membership)),
            memory_limit=self.memory_limit, master_groups=self.master_groups)
        starting = [self.server.start()]
        if self._runs_witness(membership):
            self.witness = EmbeddedNats(self.store_dir.parent / WITNESS_DIR, port=0, server_name=self.witness_name,
                                        cluster=ClusterLink(name=membership.cluster, host=host, port=membership.witness_port,
                                                            secret=secret, routes=[route_url(host, membership.port)],
                                                            witness=True), memory_limit=self.memory_limit,
                                        master_groups=self.master_groups)
            starting.append(self.witness.start())
        await asyncio.gather(*starting)
        if self.witness is not None:
            self._witness_supervisor = asyncio.create_task(self.witness.supervise(), name="witness nats-server")

    async def _until_member(self, timeout: float | None) -> None:
        """A working member: the meta group has a leader and JetStream answers through it. With
        no timeout it keeps trying (a cluster this node belongs to may be down), saying so."""
        assert self.server is not None
        loop = asyncio.get_running_loop()
        started = loop.time()
        next_warning = started + MEMBER_WARN_EVERY_S
        self._nc = await connect([self.server.url], name="exo-cluster-keeper")
        while timeout is None or loop.time() < started + timeout:
            meta = await meta_group(self.server.monitor_url)
            if meta is not None and meta.leader:
                try:
                    info = await self._nc.request("$JS.API.INFO", b"", timeout=2)
                    if b'"error"' not in info.data:
                        return
                except Exception as error:  # no responders / timeout while the meta group settles
                    log.debug("JetStream not answering yet: %r", error)
            if loop.time() >= next_warning:
                next_warning += MEMBER_WARN_EVERY_S
                assert self.membership is not None
                log.warning("cluster %s does not answer after %.0f s (routes: %s); still trying. If it is gone for "
                            "good, remove %s to let this node find or seed another", self.membership.cluster,
                            loop.time() - started, ", ".join(self._routes(self.membership)) or "none",
                            self.store_dir / MEMBERSHIP_FILE)
            await asyncio.sleep(0.2)
        raise BusError(f"this node's server did not become a member of cluster {self.membership and self.membership.cluster} "
                       f"within {timeout:g} s; see {self.store_dir / 'nats-server.log'}")

    async def _migrate(self) -> None:
        assert self._nc is not None and self.membership is not None
        log.info("this data dir holds a standalone store: carrying it into cluster %s", self.membership.cluster)
        await migrate_standalone_store(self.store_dir, self._nc)

    async def _undo_migration(self) -> None:
        """A failed first start of a standalone node: everything back as it was, nothing lost."""
        if self._nc is not None and not self._nc.is_closed:
            await self._nc.close()
        self.kill()
        (self.store_dir / MEMBERSHIP_FILE).unlink(missing_ok=True)
        shutil.rmtree(self.store_dir.parent / WITNESS_DIR, ignore_errors=True)
        undo_migration(self.store_dir)

    async def keep(self, record_layout: LayoutSink) -> None:
        """While the node runs: remember the members, go to three replicas, retire the witness,
        and (on the meta leader's node) keep the layout in State."""
        while True:
            try:
                await self._keep_once()
                assert self.server is not None and self._nc is not None
                # this node's server, or its witness, leads the meta group: its view is the one to keep
                for monitor in [self.server.monitor_url, *([self.witness.monitor_url] if self.witness else [])]:
                    layout = await cluster_layout(self._nc, monitor)
                    if layout is not None:
                        await record_layout(layout)
                        await self._watch_servers(layout)
                        break
            except Exception as error:  # a cluster in motion: try again at the next turn
                raise_if_cancelled()
                log.info("cluster upkeep: %r; trying again", error)
            await asyncio.sleep(KEEP_EVERY_S)

    async def _keep_once(self) -> None:
        membership, nc = self.membership, self._nc
        assert membership is not None and nc is not None
        members = sorted(p.route for p in self.discovery.peers() if p.state == "ready" and p.cluster == membership.cluster)
        if members and members != membership.routes:
            membership.routes = members
            save_membership(self.store_dir, membership)
        if len(members) + 1 < FULL_REPLICAS and len(await self._routed_members()) + 1 < FULL_REPLICAS:
            return
        if not await scale_streams(nc):
            return
        if self.witness is None:
            return
        replicated = (all(s.replicas >= FULL_REPLICAS and s.current for s in await stream_replicas(nc))
                      and await consumers_replicated(nc))
        # Twice in a row (a turn apart): replicas that just caught up once may still be settling.
        self._replicated_turns = self._replicated_turns + 1 if replicated else 0
        if self._replicated_turns >= 2:
            await self._retire_witness()

    async def _routed_members(self) -> set[str]:
        """The real servers this one has routes to: members joined by address, which mDNS may not hear."""
        assert self.server is not None
        return {name for name in await routed_servers(self.server.monitor_url) if not name.endswith("-witness")}

    async def _watch_servers(self, layout: ClusterLayout) -> None:
        """On the meta leader: say when the cluster can lose no more servers, and retire the
        servers gone for good (after `remove_after_s`)."""
        real = [s for s in layout.servers if not s.name.endswith("-witness")]
        online = sum(s.online for s in real)
        if online != self._online_shown:
            if online < FULL_REPLICAS and len(real) >= FULL_REPLICAS:
                log.warning("only %d of the cluster's %d servers are online: one more failure stops the event log; "
                            "bring them back or start another node", online, len(real))
            self._online_shown = online
        now = asyncio.get_running_loop().time()
        for server in real:
            if server.online:
                self._silent_since.pop(server.name, None)
                continue
            since = self._silent_since.setdefault(server.name, now)
            if self.settings.remove_after_s and now - since >= self.settings.remove_after_s:
                await self._retire_server(server.name)

    async def _retire_server(self, name: str) -> None:
        assert self._nc is not None and self.server is not None
        if not await move_streams_off(self._nc, name):
            return  # moving (or no spare server yet): asked again at the next turn
        system = await connect([self.server.system_url], name="exo-cluster-system")
        try:
            await remove_peer(system, name)
        finally:
            await system.close()
        self._silent_since.pop(name, None)
        log.warning("server %s was silent for %.0f s: its streams moved to other servers and it left the meta group",
                    name, self.settings.remove_after_s)

    async def _retire_witness(self) -> None:
        assert self.server is not None and self.witness is not None and self.membership is not None
        system = await connect([self.server.system_url], name="exo-cluster-system")
        try:
            await step_down_if_leader(system, self.server.monitor_url, self.witness_name)
            self.witness.stop()
            await remove_peer(system, self.witness_name)
        finally:
            await system.close()
        self.witness = None
        self.membership.witness_retired = True
        save_membership(self.store_dir, self.membership)
        log.info("three nodes hold every stream: the witness %s is retired", self.witness_name)

    async def stop(self) -> None:
        if self._witness_supervisor is not None:
            self._witness_supervisor.cancel()
        if self._nc is not None and not self._nc.is_closed:
            await self._nc.close()
        await self.discovery.stop()
        for server in (self.witness, self.server):
            if server is not None:
                server.stop()

    def kill(self) -> None:
        for server in (self.witness, self.server):
            if server is not None:
                server.kill()
