"""Asking one node's download coordinator to start, cancel or delete a model's download.

Core NATS request/reply on `exo.downloads.<node id>.<action>`: the node answers at once (the
download itself reports through events), and a node that is not running answers nothing, which
the caller hears as "unreachable" instead of a request queued for a node that may never return.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Literal

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

from exo.bus.errors import BusError
from exo.bus.peers.responders import OnRequest, Responders
from exo.bus.subjects import download_control_subject
from exo.core.ids import ModelId, NodeId

Action = Literal["start", "cancel", "delete"]
ACTIONS: tuple[Action, ...] = ("start", "cancel", "delete")


class DownloadRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Strict: a stored event with a `model_id` (card.deleted) must never read as a request."""

    model_id: ModelId


class DownloadReply(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    code: str = ""  # "not_found", "conflict", ... when not ok
    message: str = ""


class NodeUnreachable(BusError):
    pass


Handler = Callable[[Action, ModelId], Awaitable[DownloadReply]]


class DownloadControlServer:
    def __init__(self, nc: Client, node_id: NodeId, handler: Handler) -> None:
        self._nc = nc
        self._node_id = node_id
        self._handler = handler
        self._responders = Responders(nc)

    async def start(self) -> None:
        def answering(action: Action) -> OnRequest:
            async def on_request(msg: Msg) -> None:  # nats-py takes coroutine functions only
                await self._answer(msg, action)
            return on_request

        await self._responders.start({download_control_subject(self._node_id, a): answering(a) for a in ACTIONS})

    async def stop(self) -> None:
        await self._responders.stop()

    async def _answer(self, msg: Msg, action: Action) -> None:
        try:
            request = msgspec.json.decode(msg.data, type=DownloadRequest)
            reply = await self._handler(action, request.model_id)
        except msgspec.MsgspecError as error:
            reply = DownloadReply(ok=False, code="invalid", message=f"bad request: {error}")
        await msg.respond(msgspec.json.encode(reply))


async def request_download_action(nc: Client, node_id: NodeId, action: Action, model_id: ModelId,
                                  timeout: float = 30.0) -> DownloadReply:
    try:
        msg = await nc.request(download_control_subject(node_id, action),
                               msgspec.json.encode(DownloadRequest(model_id=model_id)), timeout=timeout)
    except NoRespondersError:
        raise NodeUnreachable(f"node {node_id} is not running a worker (no answer)") from None
    except (TimeoutError, NatsError) as error:
        raise NodeUnreachable(f"node {node_id} did not answer: {type(error).__name__}") from None
    return msgspec.json.decode(msg.data, type=DownloadReply)
