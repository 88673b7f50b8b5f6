"""Liveness off the log: every node sends a pulse on core NATS each heartbeat interval, and the
master times out nodes it has not heard from. Only what a node says about itself that changed
goes into the event log (exo/worker/heartbeat.py), so an idle cluster's log stays still however
many nodes it has: a pulse is one small message that no stream stores and no follower folds.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from exo.bus.inbound import from_clients_only
from exo.bus.subjects import ALL_PULSES, pulse_subject
from exo.core.ids import NodeId


class Pulse(msgspec.Struct, frozen=True, kw_only=True):
    node_id: NodeId
    incarnation: str = ""  # this process's: two processes pulsing with one node id are a cloned identity


_decoder = msgspec.json.Decoder(Pulse)


async def send_pulse(nc: Client, pulse: Pulse) -> None:
    await nc.publish(pulse_subject(pulse.node_id), msgspec.json.encode(pulse))


async def listen_for_pulses(nc: Client, on_pulse: Callable[[Pulse], None]) -> Subscription:
    async def received(msg: Msg) -> None:
        try:
            pulse = _decoder.decode(msg.data)
        except msgspec.MsgspecError:
            return  # not a pulse: whoever sent it, it says nothing about a node
        if msg.subject == pulse_subject(pulse.node_id):  # a pulse speaks for the node of its subject only
            on_pulse(pulse)

    return await nc.subscribe(ALL_PULSES, cb=from_clients_only(received))
