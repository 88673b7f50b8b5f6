"""The master: receive a command, decide, append its events, wait until State has them, ack."""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Iterator, Mapping

from nats.aio.client import Client

from exo.bus.command_queue import CommandConsumer
from exo.bus.event_log import EventLog
from exo.bus.state_view import StateView
from exo.core.commands import AnyCommand
from exo.core.types import ModelCard
from exo.master.decide import decide

log = logging.getLogger(__name__)

_ID_NAMESPACE = uuid.UUID("6f1c4a52-3c1e-4e43-9d55-0b6f8f0f2a10")


def ids_for(command_id: str) -> Iterator[str]:
    """Ids derived from the command, so a redelivered command decides the very same events."""
    return (uuid.uuid5(_ID_NAMESPACE, f"{command_id}/{n}").hex for n in itertools.count())


class Master:
    def __init__(self, nc: Client, view: StateView, builtin_cards: Mapping[str, ModelCard]) -> None:
        self._view = view
        self._log = EventLog(nc)
        self._builtin_cards = builtin_cards
        self._consumer = CommandConsumer(nc, self.handle)

    async def run(self) -> None:
        await self._consumer.run()

    def stop(self) -> None:
        self._consumer.stop()

    async def handle(self, command: AnyCommand) -> None:
        events = decide(self._view.state, command, builtin_cards=self._builtin_cards, ids=ids_for(command.command_id))
        last_seq = 0
        for n, event in enumerate(events):
            last_seq = await self._log.append(event, event_id=f"{command.command_id}:{n}")
        if last_seq:
            # The next decision must see these events, whoever else appended meanwhile.
            await self._view.wait_for(last_seq)
        log.debug("command %s -> %d event(s)", command.command_id, len(events))
