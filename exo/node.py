"""One exo node: (embedded) NATS, provisioning, then master, worker and API in one process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import platform
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

import msgspec
from aiohttp import web

from exo.api.access_log import app_runner
from exo.api.app import build_app
from exo.api.context import ApiContext
from exo.api.outcomes import CommandOutcomes
from exo.bus.catch_up import catch_up
from exo.bus.chunk_signing import ChunkSigner
from exo.bus.cluster_view import ClusterView
from exo.bus.connection import Connection, connect, redact
from exo.bus.disk_watch import DiskWatch
from exo.bus.errors import LogGap
from exo.bus.event_log import EventLog
from exo.bus.liveness import Pulse, send_pulse
from exo.bus.provision import Overrides, event_retention, placed_on, provision
from exo.bus.readers import ReaderPresence
from exo.bus.server.cluster_node import ClusterNode, DiscoverySettings, LayoutSink
from exo.bus.server.embedded import EmbeddedNats
from exo.bus.server.jetstream_cluster import event_log_replicas
from exo.bus.server.node_keys import load_node_key
from exo.bus.server.server_config import NODE_TAG
from exo.bus.state_view import StateView
from exo.core.events import ClusterLayoutChanged, Event, NodeRegistered
from exo.core.groups import groups_ranked_on, parse_groups
from exo.core.ids import ModelId, NodeId
from exo.core.revocation import removal_line, removal_of
from exo.core.state import State
from exo.core.types import ClusterLayout, ModelCard
from exo.defaults import DEFAULT_API_PORT, DEFAULT_NATS_PORT
from exo.identity import IdentityError, load_node_id, lock_data_dir
from exo.master.service import Master
from exo.models.cards import load_builtin_cards
from exo.models.dirs import DownloadSettings
from exo.models.hub import set_offline
from exo.removal_watch import run_until_removed
from exo.resources import builtin_cards_dir
from exo.runner.protocol import RunnerStart
from exo.settings.services import (
    ApiSettings,
    BusSettings,
    MasterSettings,
    ModelSettings,
    NatsSecurity,
    RunnerSettings,
    WorkerSettings,
)
from exo.telemetry.setup import configured_endpoint
from exo.worker.heartbeat import Heartbeat
from exo.worker.node_info import NodeIdentity, describe_this_node
from exo.worker.service import Worker

log = logging.getLogger(__name__)

EMBEDDED_HOST = "127.0.0.1"  # the embedded server's client port listens on loopback only (EmbeddedNats)
# A default port that is taken is replaced by the first free one of the next this many.
PORT_SEARCH = 100


@dataclass
class NodeConfig:
    data_dir: Path
    nats_urls: list[str] = field(default_factory=list)  # empty: start the embedded server
    nats_port: int = DEFAULT_NATS_PORT
    api_host: str = "0.0.0.0"
    api_port: int = DEFAULT_API_PORT
    # The default ports, not asked for: if one is taken (a second node on this machine), a free one is used.
    api_port_auto: bool = False
    nats_port_auto: bool = False
    name: str = ""  # what people call the node; "": the hostname, plus ":<API port>" when not the default
    address: str = ""  # the address this node uses for peers (--discovery-address); "": the default route's
    run_master: bool = True
    run_worker: bool = True
    run_api: bool = True
    discovery: DiscoverySettings | None = None  # None: a standalone embedded server (or the given NATS URLs)
    trusted_lan: bool = False  # discovery without a cluster secret: a risk the start banner names
    # Each service's settings (exo/settings/services.py), read once by main.py.
    security: NatsSecurity = NatsSecurity()
    bus: BusSettings = BusSettings()
    models: ModelSettings = ModelSettings()
    master: MasterSettings = MasterSettings()
    worker: WorkerSettings = WorkerSettings()
    runner: RunnerSettings = RunnerSettings()
    api: ApiSettings = ApiSettings()


# Open streams (a dashboard's /events, a long generation) get this long on Ctrl-C before they are
# cancelled: aiohttp's default of 60 s per step kept a node with a dashboard open for 122 s.
API_SHUTDOWN_S = 3.0


def merge_overrides(first: Overrides, second: Overrides) -> Overrides:
    return {name: {**first.get(name, {}), **second.get(name, {})} for name in {*first, *second}}


class StartupError(Exception):
    """A reason the node cannot start, said in one line."""


def port_problem(host: str, port: int) -> str:
    """Why `host:port` cannot be listened on ("" if it can)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            return error.strerror or str(error)
    return ""


def choose_port(host: str, port: int, auto: bool, fix: str) -> int:
    """`port` if it is free; else, for a default port (`auto`), the next free one; else a StartupError
    that says `fix`."""
    problem = port_problem(host, port)
    if not problem:
        return port
    if auto:
        for candidate in range(port + 1, port + PORT_SEARCH):
            if not port_problem(host, candidate):
                return candidate
    raise StartupError(f"cannot listen on {host}:{port}: {problem} (another exo on this machine?); {fix}")


def default_name(api_port: int | None) -> str:
    """The hostname, plus the API port when it is not the default: two nodes on one host differ."""
    host = platform.node() or socket.gethostname()
    # Port 0 (any free one) is not known yet when the node registers: the hostname alone, then.
    return host if api_port in (None, 0, DEFAULT_API_PORT) else f"{host}:{api_port}"


class Node:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.embedded: EmbeddedNats | None = None
        self.cluster: ClusterNode | None = None
        self.worker: Worker | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._nc: Connection | None = None
        self._view: ClusterView | None = None
        self._site_runner: web.AppRunner | None = None
        self.api_url = ""
        self._reader_presence: ReaderPresence | None = None  # answers for this API node's stream readers
        self._disk_watch: DiskWatch | None = None  # the embedded server's disk: full, and recovery after
        self._data_dir_lock: IO[bytes] | None = None
        self.api_keys_required = False  # set by the API at start
        self.notes: list[str] = []  # what the node chose by itself at start, for the banner
        self.event_log_replicas = 0  # on a NATS given by URL: the event log's copies (1: none to spare), for the banner
        self.name = ""
        self.removed = ""  # why this node stopped: an admin removed it (exo/core/revocation.py)

    async def start(self) -> None:
        config = self.config
        self._lock_data_dir(config.data_dir)
        self.config = config = self._choose_ports(config)
        self.name = config.name or default_name(config.api_port if config.run_api else None)
        node_id = load_node_id(config.data_dir)
        urls = config.nats_urls or [await self._start_embedded(node_id)]
        self.nats_urls = urls
        self.shown_nats_urls = [redact(url) for url in urls]
        self._nc = nc = await connect(urls, name="exo-node", security=config.security)
        overrides = event_retention(config.bus.events_max_age_s, config.bus.events_max_bytes)
        if self.cluster is not None:  # on real nodes only; the cluster raises the replicas itself
            overrides = merge_overrides(placed_on([NODE_TAG]), overrides)
        await provision(nc, replicas=config.bus.replicas, overrides=overrides, keep_replicas=self.cluster is not None,
                        forming_wait_s=config.bus.cluster_forming_wait_s)
        if config.nats_urls:
            self.event_log_replicas = await event_log_replicas(nc)
        builtin = load_builtin_cards(builtin_cards_dir())
        view = await self._catch_up(nc)
        self._view = cluster_view = ClusterView(nc, view, self._groups_wanted(node_id))
        await cluster_view.follow_groups()  # before anything acts: a late joiner has every group's requests too
        if self.cluster is not None:
            self._tasks.append(asyncio.create_task(self.cluster.keep(self._layout_recorder(nc, view)), name="cluster upkeep"))
        if config.run_master and config.master.lead_shared:
            master = Master(nc, view, builtin, node_id, config.master, signer=self._master_signer(node_id))
            self._tasks.append(asyncio.create_task(master.run(), name="master"))
        if config.run_master:
            cluster_view.on_group(lambda group_view: self._campaign_in_group(nc, group_view, view, builtin, node_id))
        if config.models.offline:
            set_offline()  # in this process; runner processes are told by the worker (runner_host.py)
        if config.run_worker:
            await self._start_worker(nc, cluster_view, node_id, builtin)
        if config.run_api:
            ctx = ApiContext(nc, cluster_view, CommandOutcomes(nc, cluster_view), builtin, node_id, config.data_dir,
                             settings=msgspec.structs.replace(config.api, load_timeout_s=config.master.load_timeout_s),
                             models=config.models)
            if (watch := self._disk_watch) is not None:
                ctx.storage_problem = lambda: watch.problem
            ctx.cluster_join = self._cluster_join
            await self._start_api(ctx)

    def _cluster_join(self) -> tuple[str, str] | None:
        """What a join token's user gets: the cluster's secret and this member's cluster address."""
        cluster, discovery = self.cluster, self.config.discovery
        usable = cluster is not None and discovery is not None and not self.config.trusted_lan and cluster.join_address
        return (discovery.secret, cluster.join_address) if usable and cluster and discovery else None

    def _groups_wanted(self, node_id: NodeId) -> Callable[[State], set[str]] | None:
        """The group logs this node folds: every one for an API node (it routes to them all); else
        those it may lead, and those of its ranks (requests its runners are given); None: all."""
        config = self.config
        if config.run_api:
            return None

        def wanted(state: State) -> set[str]:
            ranked = groups_ranked_on(state, node_id) if config.run_worker else set()
            leadable = {g for g in state.group_logs if config.master.leads_group(g)} if config.run_master else set()
            return ranked | leadable
        return wanted

    def _campaign_in_group(self, nc: Connection, group_view: StateView, shared: StateView,
                           builtin: Mapping[ModelId, ModelCard], node_id: NodeId) -> None:
        """A master candidate for a master group this node follows (unless EXO_LEAD_GROUPS leaves it out)."""
        group = group_view.names.group
        if self.config.master.leads_group(group):
            master = Master(nc, group_view, builtin, node_id, self.config.master, shared=shared,
                            signer=self._master_signer(node_id))
            self._tasks.append(asyncio.create_task(master.run(), name=f"master of group {group}"))

    def _master_signer(self, node_id: NodeId) -> ChunkSigner:
        """The node key a master signs its snapshots with (a starting node checks them against the log)."""
        return ChunkSigner.from_file(node_id, load_node_key(self.config.data_dir).seed_file)

    def _lock_data_dir(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._data_dir_lock = lock_data_dir(data_dir)
        except IdentityError as error:
            raise StartupError(f"{error}; a second node on this machine needs a data dir of its own: "
                               f"--data-dir {data_dir}-2 (or EXO_HOME)") from None

    async def _start_worker(self, nc: Connection, view: ClusterView, node_id: NodeId,
                            builtin: Mapping[ModelId, ModelCard]) -> None:
        """The worker and its heartbeat, once the node is registered in the log."""
        config = self.config
        key = load_node_key(config.data_dir)  # its chunks are signed with it; State learns the public half
        if (removal := removal_of(view.state, node_id, key.public_key)) is not None:
            raise StartupError(f"{removal_line(*removal)}; to join again as a new node, remove node_id and "
                               f"node.nk from {config.data_dir}")
        known = view.state.nodes.get(node_id)
        if known is not None and known.public_key and known.public_key != key.public_key:
            # The first key stays (exo/core/apply.py): every chunk signed with another would be dropped.
            raise StartupError(f"the cluster knows node {node_id} by another key than {key.seed_file} holds "
                               "(the file was replaced or lost): put the original file back, or start this "
                               "machine as a new node (remove node_id from its data dir)")
        identity = NodeIdentity(name=self.name, address=config.address, advertised=config.worker.advertise_addresses,
                                ring_ports=config.worker.ring_ports, offline=config.models.offline,
                                public_key=key.public_key)
        start = RunnerStart(nats_urls=self.nats_urls, security=config.security, settings=config.runner,
                            traces_endpoint=configured_endpoint(), node_id=node_id, node_key_file=str(key.seed_file))
        self.worker = worker = Worker(nc, view, node_id, config.data_dir, self.nats_urls, builtin,
                                      DownloadSettings.of(config.models, config.data_dir), settings=config.worker,
                                      runner_start=start, suspect_s=config.master.suspect_s)
        events = EventLog(nc, signer=ChunkSigner.from_file(node_id, key.seed_file))  # its heartbeats are signed

        async def append(event: Event) -> None:
            await events.append(event, uuid.uuid4().hex)

        async def pulse(incarnation: str) -> None:
            await send_pulse(nc, Pulse(node_id=node_id, incarnation=incarnation))

        heartbeat = Heartbeat(node_id, append, pulse, config.worker, prompt_caches=worker.prompt_caches, identity=identity)
        view.shared.add_listener(heartbeat.on_event)
        info = describe_this_node(node_id, heartbeat.incarnation, time.time(), identity=identity)
        await events.append(NodeRegistered(node=info), uuid.uuid4().hex)
        running = [asyncio.create_task(worker.run(), name="worker"), asyncio.create_task(heartbeat.run(), name="heartbeat")]
        self._tasks.append(asyncio.create_task(self._work_until_removed(view, node_id, running), name="worker"))

    async def _work_until_removed(self, view: ClusterView, node_id: NodeId, running: list[asyncio.Task[None]]) -> None:
        """The worker and its heartbeat; removed by an admin, they stop (its runners too) and this
        returns, which stops the whole node (its API and master too): exo/removal_watch.py."""
        self.removed = await run_until_removed(view, node_id, running)
        if self.removed and self.worker is not None:
            await self.worker.stop()

    def _choose_ports(self, config: NodeConfig) -> NodeConfig:
        """The API and embedded NATS ports: as asked, or free ones in place of taken defaults (noted)."""
        api_port, nats_port = config.api_port, config.nats_port
        if config.run_api:
            api_port = choose_port(config.api_host, api_port, config.api_port_auto,
                                   "pass another --api-port (or stop what uses it)")
        if not config.nats_urls:
            nats_port = choose_port(EMBEDDED_HOST, nats_port, config.nats_port_auto,
                                    "pass --nats-port 0 (any free port) or another --nats-port")
        taken = [f"{what} {was} -> {now}" for what, was, now in
                 (("API", config.api_port, api_port), ("NATS", config.nats_port, nats_port)) if was != now]
        if taken:
            self.notes.append(f"default ports taken (another exo on this machine?), chose: {', '.join(taken)}")
        return replace(config, api_port=api_port, nats_port=nats_port)

    async def _start_embedded(self, node_id: str) -> str:
        store = self.config.data_dir / "nats"
        groups = list(parse_groups(self.config.master.groups))
        if self.config.discovery is None:
            self.embedded = EmbeddedNats(store, port=self.config.nats_port, memory_limit=self.config.bus.nats_memory_limit,
                                         master_groups=groups)
            await self.embedded.start()
        else:
            self.cluster = ClusterNode(store, node_id, self.config.nats_port, self.config.discovery,
                                       memory_limit=self.config.bus.nats_memory_limit, master_groups=groups)
            self.embedded = await self.cluster.start()
        self._tasks.append(asyncio.create_task(self.embedded.supervise(), name="embedded nats-server"))
        self._disk_watch = DiskWatch(self.embedded)
        self._tasks.append(asyncio.create_task(self._disk_watch.run(), name="store disk watch"))
        return self.embedded.url

    @staticmethod
    def _layout_recorder(nc: Connection, view: StateView) -> LayoutSink:
        events = EventLog(nc)

        async def record(layout: ClusterLayout) -> None:
            if view.state.cluster != layout:
                await events.append(ClusterLayoutChanged(layout=layout), uuid.uuid4().hex)
        return record

    async def _catch_up(self, nc: Connection) -> StateView:
        try:
            view, self.caught_up_from = await catch_up(nc)
        except LogGap as gap:
            raise StartupError(f"cannot catch up: {gap}") from None
        return view

    async def _start_api(self, ctx: ApiContext) -> None:
        self.api_keys_required = bool(ctx.settings.api_keys)
        self._reader_presence = ReaderPresence(ctx.nc, lambda command_id: ctx.readers[command_id] > 0)
        await self._reader_presence.start()
        self._site_runner = app_runner(build_app(ctx), ctx.settings.access_log, handler_cancellation=True,
                                       shutdown_timeout=API_SHUTDOWN_S)
        await self._site_runner.setup()
        site = web.TCPSite(self._site_runner, self.config.api_host, self.config.api_port)
        try:
            await site.start()
        except OSError as error:
            raise StartupError(f"cannot listen on {self.config.api_host}:{self.config.api_port}: {error.strerror}; "
                               f"pass another --api-port") from None
        if self.config.api_port == 0:  # any free port: say the one it got
            self.config = replace(self.config, api_port=self._site_runner.addresses[0][1])
        shown_host = "localhost" if self.config.api_host in ("0.0.0.0", "::") else self.config.api_host
        self.api_url = f"http://{shown_host}:{self.config.api_port}"

    async def wait(self) -> None:
        """Returns if a service stops by itself (a bug): the node then shuts down."""
        if self._tasks:
            done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.exception():
                    log.error("%s stopped: %r", task.get_name(), task.exception())
        else:
            await asyncio.Event().wait()

    async def stop(self) -> None:
        if self._site_runner is not None:
            await self._site_runner.cleanup()
        if self._reader_presence is not None:
            await self._reader_presence.stop()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=10)  # a stuck service must not block Ctrl-C
        if self.worker is not None:
            await self.worker.stop()
        if self._view is not None:
            await self._view.stop()
        if self._nc is not None and not self._nc.is_closed:
            with contextlib.suppress(Exception):  # the server may be gone already; we are leaving anyway
                await asyncio.wait_for(self._nc.drain(), 5)
        if self.cluster is not None:
            await self.cluster.stop()
        elif self.embedded is not None:
            self.embedded.stop()
        if (lock := getattr(self, "_data_dir_lock", None)) is not None:
            lock.close()  # another Node in this process may use the dir now
            self._data_dir_lock = None

    def kill(self) -> None:
        """The second Ctrl-C: no more waiting."""
        if self.worker is not None:
            self.worker.kill_runners()
        if self.cluster is not None:
            self.cluster.kill()
        elif self.embedded is not None:
            self.embedded.kill()
