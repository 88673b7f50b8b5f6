"""A node's heartbeat: its NodeInfo as an event every few seconds, so the master can time it out."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping

from exo.core.events import AnyEvent, Event, NodeHeartbeat
from exo.core.ids import InstanceId, NodeId
from exo.core.state import State
from exo.core.types import PromptCacheStats
from exo.worker.node_info import describe_this_node

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 5.0


def heartbeat_interval() -> float:
    return float(os.environ.get("EXO_HEARTBEAT_S", DEFAULT_INTERVAL_S))


class Heartbeat:
    def __init__(self, node_id: NodeId, publish: Callable[[Event], Awaitable[None]], interval: float | None = None,
                 prompt_caches: Callable[[], Mapping[InstanceId, PromptCacheStats]] = dict) -> None:
        self.node_id = node_id
        self._prompt_caches = prompt_caches  # this node's runners' prompt caches, by instance
        self.incarnation = uuid.uuid4().hex[:12]
        self._publish = publish
        self._interval = heartbeat_interval() if interval is None else interval
        self._warned = False
        self._started = time.time()

    async def run(self) -> None:
        while True:
            try:
                await self._publish(NodeHeartbeat(node=describe_this_node(
                    self.node_id, self.incarnation, time.time(), dict(self._prompt_caches()))))
            except Exception as error:  # the broker may be away; the next beat tries again
                log.warning("heartbeat not sent: %r", error)
            await asyncio.sleep(self._interval)

    def on_event(self, seq: int, event: AnyEvent, state: State) -> None:
        """Another live process beating with our node id: a cloned identity. Say so loudly."""
        if isinstance(event, NodeHeartbeat) and event.node.node_id == self.node_id:
            clone = event.node.incarnation not in ("", self.incarnation) and event.node.last_seen > self._started
            if clone and not self._warned:
                self._warned = True
                log.error(
                    "another process (host %s, incarnation %s) sends heartbeats as node %s: two nodes share one "
                    "id; give one of them its own data dir", event.node.hostname, event.node.incarnation, self.node_id,
                )
