"""Only clients' own messages reach exo's core-NATS handlers, never a JetStream delivery.

Any user who may create a consumer (the read-only operator may: `nats stream view` needs one)
can make the server itself deliver stored messages to any subject as a push consumer's
`deliver_subject`: publish permissions never apply to the server's deliveries. Aimed at
`exo.downloads.<node>.delete`, a stored `card.deleted` event (it has a `model_id`) would read as a
request to delete a model's files. Deny lists of today's subjects cannot close that, so every
core subscription exo makes drops whatever a JetStream consumer delivered, whatever the subject:
such a message always carries the consumer's `$JS.ACK.` reply (or `$JS.FC.` for flow control),
or is an idle heartbeat (status 100, no body). Request decoders are strict as well
(unknown fields refused), so an event can never pass for a request.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg

log = logging.getLogger(__name__)

OnMessage = Callable[[Msg], Awaitable[None]]

def delivered_by_jetstream(msg: Msg) -> bool:
    """Whether the server's JetStream delivered this (a push consumer), not a client's publish."""
    if msg.reply.startswith("$JS."):
        return True
    # A push consumer's idle heartbeat (status 100, no reply). Other statuses (503: no responders
    # to a request) are the server answering a client's own publish, as before.
    return bool(msg.headers) and (msg.headers or {}).get("Status") == "100"


def from_clients_only(handler: OnMessage) -> OnMessage:
    """`handler`, for messages clients published; JetStream deliveries are dropped and counted."""

    dropped = 0

    async def guarded(msg: Msg) -> None:
        nonlocal dropped
        if delivered_by_jetstream(msg):
            dropped += 1
            if dropped == 1 or dropped % 1000 == 0:  # a flood must not flood the log too
                log.warning("dropped %d message(s) a JetStream consumer delivered to exo's own subjects "
                            "(latest on %s, from %s): someone created a push consumer aimed at them",
                            dropped, msg.subject, msg.reply or "a status message")
            return
        await handler(msg)

    return guarded
