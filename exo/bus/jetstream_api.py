"""One call of the JetStream API, one stored message, and the error that says the JetStream cluster is still forming."""

from __future__ import annotations

import json
from typing import Any

from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext, api

from exo.bus.errors import BusError


class ClusterForming(BusError):
    pass


async def jetstream_request(nc: Client, subject: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """One JetStream API call; its JSON answer (errors in it are the caller's to read)."""
    try:
        msg = await nc.request(subject, json.dumps(body or {}).encode(), timeout=5)
    except (NoRespondersError, NatsTimeoutError) as error:  # JetStream not answering: a cluster between leaders
        raise ClusterForming(f"JetStream did not answer {subject}: {error!r}") from None
    answer: dict[str, Any] = json.loads(msg.data)  # the JetStream API answers with a JSON object
    return answer


async def get_stored(js: JetStreamContext, stream: str, *, seq: int | None = None, subject: str | None = None,
                     next_by_subject: bool = False) -> api.RawStreamMsg:
    """One stored message with its headers: by a direct get, whose answer is the message itself,
    unless the stream does not allow them; the API's answer is JSON with the payload in base64,
    several ms more for a State snapshot. NotFoundError when there is none."""
    try:
        return await js.get_msg(stream, seq=seq, subject=subject, next=next_by_subject, direct=True)
    except NoRespondersError:
        return await js.get_msg(stream, seq=seq, subject=subject, next=next_by_subject)
