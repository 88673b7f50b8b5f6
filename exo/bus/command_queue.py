"""Commands to the master: the EXO_COMMANDS stream and the master's durable pull consumer."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout

from exo.bus.publish import publish_durably
from exo.bus.subjects import COMMANDS_STREAM, MASTER_CONSUMER, command_subject
from exo.core.commands import AnyCommand, Command, command_tag, decode_command, encode_command

log = logging.getLogger(__name__)

OnCommand = Callable[[AnyCommand], Awaitable[None]]


class NotLeader(Exception):
    """The master lost its lease while handling a command: leave the command to the next one."""


async def send_command(nc: Client, command: Command) -> None:
    """Durably queue a command; Nats-Msg-Id makes a retried send harmless."""
    subject = command_subject(command_tag(command))
    await publish_durably(nc, subject, encode_command(command), COMMANDS_STREAM, command.command_id)


async def consume_commands(nc: Client, on_command: OnCommand, still_leader: Callable[[], bool]) -> None:
    """Pull commands one at a time while `still_leader()`; a command is acked only after
    `on_command` returned, so one that a dying master held is redelivered to the next."""
    subscription = await nc.jetstream().pull_subscribe_bind(MASTER_CONSUMER, stream=COMMANDS_STREAM)
    try:
        while still_leader():
            try:
                messages = await subscription.fetch(batch=1, timeout=1)
            except NatsTimeout:
                continue
            except NatsError as error:  # a reconnect or a stream leader change: ask again
                log.info("fetching commands: %r", error)
                await asyncio.sleep(0.5)
                continue
            for msg in messages:
                if not await _handle(msg, on_command, still_leader):
                    return
    finally:
        try:  # bounded: a fetch cancelled mid-request must not hold up shutdown
            await asyncio.wait_for(subscription.unsubscribe(), 5)
        except (asyncio.TimeoutError, NatsError):
            pass


async def _handle(msg, on_command: OnCommand, still_leader: Callable[[], bool]) -> bool:
    """False when this master must stop consuming."""
    if not still_leader():
        await msg.nak()
        return False
    try:
        command = decode_command(msg.data)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        log.error("dropping undecodable command on %s: %s", msg.subject, error)
        await msg.term()
        return True
    try:
        await on_command(command)
    except asyncio.CancelledError:
        raise
    except NotLeader:
        await msg.nak()
        return False
    except Exception:
        log.exception("command %s failed; it will be redelivered", command.command_id)
        await msg.nak(delay=1)
        return True
    await msg.ack()
    return True
