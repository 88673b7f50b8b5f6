"""A node an admin removed (`exo node remove`, exo/core/revocation.py) stops instead of running
on: its worker and heartbeat at once, then the whole node, with one line saying who removed it
and why."""

from __future__ import annotations

import asyncio
import logging

from exo.bus.cluster_view import ClusterView
from exo.core.events import AnyEvent
from exo.core.ids import NodeId
from exo.core.revocation import removal_line
from exo.core.state import State

log = logging.getLogger("exo.node")


async def run_until_removed(view: ClusterView, node_id: NodeId, running: list[asyncio.Task[None]]) -> str:
    """Await `running` (the worker and its heartbeat) until State shows this node removed: then
    cancel them and return the removal's line. "" when one of them ended by itself (its error is
    raised, as if it had run on its own)."""
    removed = asyncio.Event()

    def on_event(seq: int, event: AnyEvent, state: State) -> None:
        if node_id in state.revoked_nodes:  # its own node.removed, or a State that has it (a snapshot)
            removed.set()
    view.shared.add_listener(on_event)
    watch = asyncio.create_task(removed.wait())
    try:
        done, _ = await asyncio.wait({watch, *running}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (watch, *running):
            task.cancel()
        await asyncio.wait({watch, *running}, timeout=10)
    if watch not in done:
        if (error := next(iter(done)).exception()) is not None:
            raise error
        return ""
    line = removal_line(node_id, view.state.revoked_nodes[node_id])
    log.error("%s: its worker, runners and API stop; it cannot rejoin as this node", line)
    return line
