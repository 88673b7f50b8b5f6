"""Finding the other exo nodes on the LAN: mDNS (zeroconf) service `_exo._tcp`, one record per
node, its Announcement in the TXT record. What a node does with what it finds is
exo/bus/server/cluster_formation.py's to decide.

Bound to the addresses given (127.0.0.1 alone keeps it on this machine: tests). Registering
takes ~1.1 s (mDNS probing); a browser hears a registered peer in ~0.1 s, and TXT changes and
goodbyes as fast.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import msgspec
from zeroconf import IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from exo.bus.server.cluster_formation import Announcement

log = logging.getLogger(__name__)

SERVICE_TYPE = "_exo._tcp.local."
RESOLVE_TIMEOUT_MS = 3000


def _instance_name(announcement: Announcement) -> str:
    return f"{announcement.namespace}-{announcement.node_id}.{SERVICE_TYPE}"


def _service_info(announcement: Announcement) -> AsyncServiceInfo:
    properties = {field: str(getattr(announcement, field)) for field in announcement.__struct_fields__}
    return AsyncServiceInfo(
        SERVICE_TYPE, _instance_name(announcement), port=announcement.cluster_port or 1,
        addresses=[socket.inet_aton(announcement.host)] if announcement.host else [], properties=properties,
        server=f"exo-{announcement.namespace}-{announcement.node_id}.local.",
    )


def _announcement_of(info: AsyncServiceInfo) -> Announcement | None:
    """The peer's announcement from its TXT record; None for a record that is not one of ours."""
    text = {key.decode(): (value or b"").decode() for key, value in info.properties.items()}
    try:
        return msgspec.convert(text, Announcement, strict=False)
    except msgspec.ValidationError as error:
        log.info("discovery: ignoring %s: %s", info.name, error)
        return None


class NoDiscovery:
    """Discovery off (`--no-discovery --join HOST:PORT`): announces nothing, hears no one."""

    def __init__(self) -> None:
        self.changed = asyncio.Event()

    async def start(self, me: Announcement) -> None:
        pass

    async def announce(self, me: Announcement) -> None:
        pass

    def peers(self) -> list[Announcement]:
        return []

    async def stop(self) -> None:
        pass


class Discovery:
    """Announces this node and keeps the table of the peers it hears."""

    def __init__(self, addresses: list[str]) -> None:
        self._zeroconf = AsyncZeroconf(interfaces=addresses, ip_version=IPVersion.V4Only)
        self._browser: AsyncServiceBrowser | None = None
        self._me: Announcement | None = None
        self._peers: dict[str, Announcement] = {}  # by mDNS instance name
        self._resolving: set[asyncio.Task[None]] = set()
        self.changed = asyncio.Event()  # set whenever the peer table changes

    async def start(self, me: Announcement) -> None:
        self._me = me
        await self._zeroconf.async_register_service(_service_info(me))
        self._browser = AsyncServiceBrowser(self._zeroconf.zeroconf, [SERVICE_TYPE], handlers=[self._on_change])

    async def announce(self, me: Announcement) -> None:
        """Say something new of this node (its state, its cluster)."""
        self._me = me
        await self._zeroconf.async_update_service(_service_info(me))

    def peers(self) -> list[Announcement]:
        """The other nodes heard in this node's namespace, with this node's cluster secret."""
        me = self._me
        return [p for p in self._peers.values() if me is None
                or (p.namespace == me.namespace and p.secret_id == me.secret_id and p.node_id != me.node_id)]

    async def stop(self) -> None:
        if self._browser is not None:
            await self._browser.async_cancel()
        for task in self._resolving:
            task.cancel()
        await self._zeroconf.async_unregister_all_services()
        await self._zeroconf.async_close()

    # zeroconf calls handlers by keyword: the parameter names are its.
    def _on_change(self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Removed:
            if self._peers.pop(name, None) is not None:
                self.changed.set()
            return
        task = asyncio.get_running_loop().create_task(self._resolve(name))
        self._resolving.add(task)
        task.add_done_callback(self._resolving.discard)

    async def _resolve(self, name: str) -> None:
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(self._zeroconf.zeroconf, RESOLVE_TIMEOUT_MS):
            return
        announcement = _announcement_of(info)
        if announcement is not None and self._peers.get(name) != announcement:
            self._peers[name] = announcement
            self.changed.set()
