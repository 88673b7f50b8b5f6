"""Who is reading a generation, across API nodes.

A stream whose client drops is cancelled after a grace period unless a client came back for it
(`Last-Event-ID`). The client may come back on another API node, and several clients may read
one generation; so before cancelling, a node asks on `exo.readers.<command id>` and every API
node that has a reader of that generation answers. Silence (within `ASK_TIMEOUT_S`) means none.
"""

from __future__ import annotations

from collections.abc import Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from exo.bus.peers.responders import Responders
from exo.bus.subjects import ALL_READERS, readers_subject
from exo.core.ids import CommandId

ASK_TIMEOUT_S = 0.5  # every API node answers at once from memory; this is a round trip and more


class ReaderPresence:
    """Answers for this node: 'reading' for each generation `is_reading` says it has a reader of."""

    def __init__(self, nc: Client, is_reading: Callable[[CommandId], bool]) -> None:
        self._nc = nc
        self._is_reading = is_reading
        self._responders = Responders(nc)

    async def start(self) -> None:
        await self._responders.start({ALL_READERS: self._on_ask})

    async def stop(self) -> None:
        await self._responders.stop()

    async def _on_ask(self, msg: Msg) -> None:
        if msg.reply and self._is_reading(CommandId(msg.subject.rsplit(".", 1)[-1])):
            await msg.respond(b"reading")


async def read_anywhere(nc: Client, command_id: CommandId) -> bool:
    """Whether any API node (this one included) has a reader of the generation now."""
    try:
        await nc.request(readers_subject(command_id), b"", timeout=ASK_TIMEOUT_S)
    except (TimeoutError, NatsError):  # no responders, or none reading: nobody answered
        return False
    return True
