"""Work a request leaves behind (the cancel after its client left) publishes with the services'
patience (RETRY_FOR_S), not the request's shorter one (exo/api/bus_outage.py sets that per request):
a JetStream leader change of over 10 s must not drop the cancel."""

from __future__ import annotations

import asyncio

from exo.api.context import _with_service_patience
from exo.background import Background
from exo.bus.publish import RETRY_FOR_S, publish_patience


async def test_background_work_started_under_a_request_gets_the_services_patience():
    seen: list[float] = []

    async def cancel_after_the_client_left() -> None:
        seen.append(publish_patience.get())

    background = Background("test")
    token = publish_patience.set(10.0)  # as under a request
    try:
        await background.start(_with_service_patience(cancel_after_the_client_left()))
        assert publish_patience.get() == 10.0  # the request's own context is left as it was
    finally:
        publish_patience.reset(token)
    assert seen == [RETRY_FOR_S] and RETRY_FOR_S > 10.0
    await asyncio.sleep(0)
