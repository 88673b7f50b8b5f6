"""StateView listeners: one that fails must not keep an event from the others."""

from __future__ import annotations

import logging

from exo.bus.event_log import EventLog
from exo.bus.state_view import StateView
from exo.core.events import NodeRegistered
from exo.core.types import NodeInfo
from tests.conftest import eventually


async def test_a_failing_listener_does_not_keep_events_from_the_listeners_after_it(nc, caplog):
    # On a node, the worker's listener comes before the API's: if its failure (a full disk
    # under the card folder, say) hid the event from the API, a chat waiting for its task's
    # end would hang until its client gave up.
    log = EventLog(nc)
    view = StateView(nc)
    seen: list[int] = []

    def failing(seq, event, state) -> None:
        raise OSError("no space left on device")

    async def recording(seq, event, state) -> None:
        seen.append(seq)

    view.add_listener(failing)
    view.add_listener(recording)
    await view.start()
    try:
        with caplog.at_level(logging.ERROR, logger="exo.bus.state_view"):
            first = await log.append(NodeRegistered(node=NodeInfo(node_id="a")), "listener-test-1")
            second = await log.append(NodeRegistered(node=NodeInfo(node_id="b")), "listener-test-2")
            await eventually(lambda: second in seen, timeout=10)
        assert first in seen and view.state.last_seq >= second
        assert "a State listener failed" in caplog.text and "no space left on device" in caplog.text
    finally:
        await view.stop()
