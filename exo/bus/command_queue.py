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
OnPoison = Callable[[AnyCommand, str], Awaitable[None]]

# A command whose handling failed this many times is answered with an error and dropped: a bug
# must not loop one command forever (the consumer itself allows any number of deliveries).
MAX_COMMAND_ATTEMPTS = 3
RETRY_DELAY_S = 1.0


class NotLeader(Exception):
    """The master lost its lease while handling a command: leave the command to the next one."""


async def send_command(nc: Client, command: Command) -> None:
    """Durably queue a command; Nats-Msg-Id makes a retried send harmless."""
    subject = command_subject(command_tag(command))
    await publish_durably(nc, subject, encode_command(command), COMMANDS_STREAM, command.command_id)


async def consume_commands(nc: Client, on_command: OnCommand, still_leader: Callable[[], bool],
                           on_poison: OnPoison | None = None) -> None:
    """Pull commands one at a time while `still_leader()`; a command is acked only after
    `on_command` returned, so one that a dying master held is redelivered to the next. One whose
    handling keeps failing goes to `on_poison` (which answers its caller) after MAX_COMMAND_ATTEMPTS."""
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
                if not await _handle(msg, on_command, still_leader, on_poison):
                    return
    finally:
        try:  # bounded: a fetch cancelled mid-request must not hold up shutdown
            await asyncio.wait_for(subscription.unsubscribe(), 5)
        except (asyncio.TimeoutError, NatsError):
            pass


async def _handle(msg, on_command: OnCommand, still_leader: Callable[[], bool], on_poison: OnPoison | None) -> bool:
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
    except Exception as error:
        attempts = msg.metadata.num_delivered
        if on_poison is None or attempts < MAX_COMMAND_ATTEMPTS:
            log.exception("command %s failed (attempt %d); it will be redelivered", command.command_id, attempts)
            await msg.nak(delay=RETRY_DELAY_S)
            return True
        log.exception("command %s failed %d times; answering it with the error", command.command_id, attempts)
        return await _give_up(msg, command, f"{type(error).__name__}: {error}", on_poison)
    await msg.ack()
    return True


async def _give_up(msg, command: AnyCommand, error: str, on_poison: OnPoison) -> bool:
    try:
        await on_poison(command, error)
    except NotLeader:
        await msg.nak()
        return False
    except Exception:  # could not even answer it (the broker is away): try the whole command again later
        log.exception("cannot answer failed command %s", command.command_id)
        await msg.nak(delay=RETRY_DELAY_S)
        return True
    await msg.term()
    return True
