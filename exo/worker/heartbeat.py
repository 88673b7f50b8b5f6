"""A node's heartbeat: a pulse on core NATS every few seconds, so the master can time it out, and
its NodeInfo as an event only when something placement or routing reads has changed.

An idle node therefore writes nothing to the log (1,000 nodes beating every 5 s as events were
200 events/s, folded by every follower and kept in every snapshot). A node that State no longer
holds (timed out while partitioned) describes itself again at its next beat.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping

from exo.bus.errors import raise_if_cancelled
from exo.core.events import AnyEvent, Event, NodeHeartbeat, NodeRegistered
from exo.core.ids import InstanceId, NodeId
from exo.core.state import State
from exo.core.types import NodeInfo, PromptCacheStats
from exo.settings.services import WorkerSettings
from exo.worker.node_info import NodeIdentity, describe_this_node

log = logging.getLogger(__name__)

# Free memory moves all the time; placement needs it to a few percent, not to the byte.
MEMORY_CHANGE = 0.05  # of the node's total memory


def worth_an_event(told: NodeInfo | None, now: NodeInfo) -> bool:
    """Whether State should hear `now`, having last been told `told` (None: nothing, or State
    dropped this node): what placement and routing read changed, memory by more than MEMORY_CHANGE."""
    if told is None:
        return True
    same = (told.hostname, told.memory_total, told.cpu_count, told.backend, told.addresses, told.ring_port_first,
            told.ring_port_count, told.incarnation, told.prompt_caches) == (
        now.hostname, now.memory_total, now.cpu_count, now.backend, now.addresses, now.ring_port_first,
        now.ring_port_count, now.incarnation, now.prompt_caches)
    return not same or abs(now.memory_available - told.memory_available) > MEMORY_CHANGE * max(now.memory_total, 1)


class Heartbeat:
    def __init__(self, node_id: NodeId, publish: Callable[[Event], Awaitable[None]],
                 pulse: Callable[[str], Awaitable[None]], settings: WorkerSettings = WorkerSettings(),
                 prompt_caches: Callable[[], Mapping[InstanceId, PromptCacheStats]] = dict,
                 identity: NodeIdentity = NodeIdentity()) -> None:
        self.node_id = node_id
        self.identity = identity  # name and address, as the node registered them
        self._prompt_caches = prompt_caches  # this node's runners' prompt caches, by instance
        self.incarnation = uuid.uuid4().hex[:12]
        self._publish = publish
        self._pulse = pulse
        # A pulse (one small core-NATS message, stored nowhere) comes more often than the heartbeat: the
        # master suspects a node whose pulses stop for EXO_SUSPECT_S and moves its generations (heal.py).
        self._interval, self._pulse_s = settings.heartbeat_s, settings.pulse_s
        self._warned = False
        self._started = time.time()
        self._told: NodeInfo | None = None  # what State holds of this node, as this process last said it

    async def run(self) -> None:
        last_beat = float("-inf")
        while True:
            try:
                if time.monotonic() - last_beat >= self._interval:
                    last_beat = time.monotonic()
                    await self.beat()
                else:
                    await self._pulse(self.incarnation)
            except Exception as error:  # the broker may be away; the next beat tries again
                raise_if_cancelled()
                log.warning("heartbeat not sent: %r", error)
            await asyncio.sleep(min(self._interval, self._pulse_s))

    async def beat(self) -> None:
        await self._pulse(self.incarnation)
        info = describe_this_node(self.node_id, self.incarnation, time.time(), dict(self._prompt_caches()),
                                  self.identity)
        if worth_an_event(self._told, info):
            await self._publish(NodeHeartbeat(node=info))
            self._told = info

    def on_event(self, seq: int, event: AnyEvent, state: State) -> None:
        if self.node_id not in state.nodes:
            self._told = None  # timed out (or never registered): the next beat registers it again
        elif isinstance(event, (NodeRegistered, NodeHeartbeat)) and event.node.node_id == self.node_id:
            self._on_own_node(event.node)

    def _on_own_node(self, node: NodeInfo) -> None:
        """State now holds this description. Another live process's, with our node id, is a cloned
        identity: say so loudly."""
        if node.incarnation == self.incarnation:
            self._told = node
            return
        clone = node.incarnation not in ("", self.incarnation) and node.last_seen > self._started
        if clone and not self._warned:
            self._warned = True
            log.error(
                "another process (host %s, incarnation %s) describes itself as node %s: two nodes share one "
                "id; give one of them its own data dir", node.hostname, node.incarnation, self.node_id,
            )
