"""A node's request/reply handlers (download control, model sharing): subscribed together and
flushed, so requests reach them as soon as `start` returns, and unsubscribed together."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError

from exo.bus.inbound import from_clients_only

OnRequest = Callable[[Msg], Awaitable[None]]


class Responders:
    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._subscriptions: list[Subscription] = []

    async def start(self, handlers: Mapping[str, OnRequest]) -> None:
        for subject, handler in handlers.items():
            self._subscriptions.append(await self._nc.subscribe(subject, cb=from_clients_only(handler)))
        await self._nc.flush()  # the server knows the subscriptions: requests reach us from now on

    async def stop(self) -> None:
        for subscription in self._subscriptions:
            with contextlib.suppress(NatsError):  # the connection may be closing already
                await subscription.unsubscribe()
        self._subscriptions = []
