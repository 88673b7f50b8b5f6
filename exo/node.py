"""One exo node: (embedded) NATS, provisioning, then master, worker and API in one process."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from aiohttp import web

from exo.api.app import build_app
from exo.api.auth import warn_if_exposed
from exo.api.context import ApiContext
from exo.api.outcomes import CommandOutcomes
from exo.bus.catch_up import catch_up
from exo.bus.cluster_node import ClusterNode, DiscoverySettings
from exo.bus.connection import Connection, connect, redact
from exo.bus.disk_watch import DiskWatch
from exo.bus.embedded import EmbeddedNats
from exo.bus.errors import LogGap
from exo.bus.event_log import EventLog
from exo.bus.liveness import Pulse, send_pulse
from exo.bus.provision import Overrides, event_retention, placed_on, provision
from exo.bus.readers import ReaderPresence
from exo.bus.server_config import NODE_TAG
from exo.bus.state_view import StateView
from exo.core.events import ClusterLayoutChanged, Event, NodeRegistered
from exo.core.types import ClusterLayout
from exo.master.service import Master
from exo.models.cards import load_builtin_cards
from exo.models.dirs import DownloadSettings
from exo.models.hub import set_offline
from exo.resources import builtin_cards_dir
from exo.worker.heartbeat import Heartbeat
from exo.worker.identity import IdentityError, load_node_id, lock_data_dir
from exo.worker.node_info import describe_this_node
from exo.worker.service import Worker

log = logging.getLogger(__name__)


@dataclass
class NodeConfig:
    data_dir: Path
    nats_urls: list[str] = field(default_factory=list)  # empty: start the embedded server
    nats_port: int = 4222
    api_host: str = "0.0.0.0"
    api_port: int = 52415
    run_master: bool = True
    run_worker: bool = True
    run_api: bool = True
    snapshot_every: int = 1000  # events between State snapshots...
    snapshot_interval: float = 30.0  # ...or seconds, whichever comes first
    events_max_age_s: float | None = None  # None: as streams/EXO_EVENTS.json says
    events_max_bytes: int | None = None
    offline: bool = False  # models only from local directories: no Hub, no peers
    model_sharing: bool | None = None  # serve models to peers and fetch from them; None: EXO_MODEL_SHARING (on)
    replicas: int | None = None  # None: as streams/*.json say (1)
    max_queue: int | None = None  # open tasks per instance before 429; None: decide's default
    node_timeout: float = 30.0  # seconds without a heartbeat before the master times a node out
    discovery: DiscoverySettings | None = None  # None: a standalone embedded server (or the given NATS URLs)


# Open streams (a dashboard's /events, a long generation) get this long on Ctrl-C before they are
# cancelled: aiohttp's default of 60 s per step kept a node with a dashboard open for 122 s.
API_SHUTDOWN_S = 3.0


def merge_overrides(first: Overrides, second: Overrides) -> Overrides:
    return {name: {**first.get(name, {}), **second.get(name, {})} for name in {*first, *second}}


class StartupError(Exception):
    """A reason the node cannot start, said in one line."""


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            raise StartupError(f"cannot listen on {host}:{port}: {error.strerror}") from None


class Node:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.embedded: EmbeddedNats | None = None
        self.cluster: ClusterNode | None = None
        self.worker: Worker | None = None
        self._tasks: list[asyncio.Task] = []
        self._nc: Connection | None = None
        self._view: StateView | None = None
        self._site_runner: web.AppRunner | None = None
        self.api_url = ""
        self._reader_presence: ReaderPresence | None = None  # answers for this API node's stream readers
        self._disk_watch: DiskWatch | None = None  # the embedded server's disk: full, and recovery after
        self._data_dir_lock: IO[bytes] | None = None

    async def start(self) -> None:
        config = self.config
        config.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._data_dir_lock = lock_data_dir(config.data_dir)
        except IdentityError as error:
            raise StartupError(str(error)) from None
        if config.run_api:
            check_port_free(config.api_host, config.api_port)
        node_id = load_node_id(config.data_dir)
        urls = config.nats_urls or [await self._start_embedded(node_id)]
        self.nats_urls = urls
        self.shown_nats_urls = [redact(url) for url in urls]
        self._nc = nc = await connect(urls, name="exo-node")
        overrides = event_retention(config.events_max_age_s, config.events_max_bytes)
        if self.cluster is not None:  # on real nodes only; the cluster raises the replicas itself
            overrides = merge_overrides(placed_on([NODE_TAG]), overrides)
        await provision(nc, replicas=config.replicas, overrides=overrides, keep_replicas=self.cluster is not None)
        builtin = load_builtin_cards(builtin_cards_dir())
        self._view = view = await self._catch_up(nc)
        if self.cluster is not None:
            self._tasks.append(asyncio.create_task(self.cluster.keep(self._layout_recorder(nc, view)), name="cluster upkeep"))
        if config.run_master:
            master = Master(nc, view, builtin, node_id, config.snapshot_every, config.snapshot_interval, config.max_queue,
                            node_timeout=config.node_timeout)
            self._tasks.append(asyncio.create_task(master.run(), name="master"))
        if config.offline:
            set_offline()
            os.environ["HF_HUB_OFFLINE"] = "1"  # runner processes inherit it
        if config.run_worker:
            downloads = DownloadSettings.from_env(config.data_dir, offline=config.offline, share=config.model_sharing)
            self.worker = Worker(nc, view, node_id, config.data_dir, urls, builtin, downloads)
            events = EventLog(nc)
            async def append(event: Event) -> None:
                await events.append(event, uuid.uuid4().hex)

            async def pulse(incarnation: str) -> None:
                await send_pulse(nc, Pulse(node_id=node_id, incarnation=incarnation))

            heartbeat = Heartbeat(node_id, append, pulse, prompt_caches=self.worker.prompt_caches)
            view.add_listener(heartbeat.on_event)
            info = describe_this_node(node_id, heartbeat.incarnation, time.time())
            await events.append(NodeRegistered(node=info), uuid.uuid4().hex)
            self._tasks.append(asyncio.create_task(self.worker.run(), name="worker"))
            self._tasks.append(asyncio.create_task(heartbeat.run(), name="heartbeat"))
        if config.run_api:
            ctx = ApiContext(nc, view, CommandOutcomes(nc, view), builtin, node_id, config.data_dir)
            if (watch := self._disk_watch) is not None:
                ctx.storage_problem = lambda: watch.problem
            await self._start_api(ctx)

    async def _start_embedded(self, node_id: str) -> str:
        store = self.config.data_dir / "nats"
        if self.config.discovery is None:
            self.embedded = EmbeddedNats(store, port=self.config.nats_port)
            await self.embedded.start()
        else:
            self.cluster = ClusterNode(store, node_id, self.config.nats_port, self.config.discovery)
            self.embedded = await self.cluster.start()
        self._tasks.append(asyncio.create_task(self.embedded.supervise(), name="embedded nats-server"))
        self._disk_watch = DiskWatch(self.embedded)
        self._tasks.append(asyncio.create_task(self._disk_watch.run(), name="store disk watch"))
        return self.embedded.url

    @staticmethod
    def _layout_recorder(nc: Connection, view: StateView):
        events = EventLog(nc)

        async def record(layout: ClusterLayout) -> None:
            if view.state.cluster != layout:
                await events.append(ClusterLayoutChanged(layout=layout), uuid.uuid4().hex)
        return record

    async def _catch_up(self, nc) -> StateView:
        try:
            view, self.caught_up_from = await catch_up(nc)
        except LogGap as gap:
            raise StartupError(f"cannot catch up: {gap}") from None
        return view

    async def _start_api(self, ctx: ApiContext) -> None:
        warn_if_exposed(self.config.api_host, ctx.settings)
        self._reader_presence = ReaderPresence(ctx.nc, lambda command_id: ctx.readers[command_id] > 0)
        await self._reader_presence.start()
        self._site_runner = web.AppRunner(build_app(ctx), handler_cancellation=True, access_log=None,
                                          shutdown_timeout=API_SHUTDOWN_S)
        await self._site_runner.setup()
        site = web.TCPSite(self._site_runner, self.config.api_host, self.config.api_port)
        try:
            await site.start()
        except OSError as error:
            raise StartupError(f"cannot listen on {self.config.api_host}:{self.config.api_port}: {error.strerror}") from None
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
            try:
                await asyncio.wait_for(self._nc.drain(), 5)
            except Exception:  # the server may be gone already; we are leaving anyway
                pass
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
