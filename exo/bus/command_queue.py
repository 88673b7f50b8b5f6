"""Commands to the master: the EXO_COMMANDS stream and the master's durable pull consumer."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeout

from exo.bus.subjects import COMMANDS_STREAM, MASTER_CONSUMER, command_subject
from exo.core.commands import AnyCommand, Command, command_tag, decode_command, encode_command

log = logging.getLogger(__name__)

OnCommand = Callable[[AnyCommand], Awaitable[None]]


async def send_command(nc: Client, command: Command) -> None:
    """Durably queue a command; Nats-Msg-Id makes a retried send harmless."""
    await nc.jetstream().publish(
        command_subject(command_tag(command)),
        encode_command(command),
        stream=COMMANDS_STREAM,
        headers={"Nats-Msg-Id": command.command_id},
    )


class CommandConsumer:
    """Pulls commands one at a time; a command is acked only after `on_command` returned,
    so a master that dies mid-command leaves it to be redelivered to the next master."""

    def __init__(self, nc: Client, on_command: OnCommand) -> None:
        self._js = nc.jetstream()
        self._on_command = on_command
        self._running = False

    async def run(self) -> None:
        subscription = await self._js.pull_subscribe_bind(MASTER_CONSUMER, stream=COMMANDS_STREAM)
        self._running = True
        while self._running:
            try:
                messages = await subscription.fetch(batch=1, timeout=5)
            except NatsTimeout:
                continue
            for msg in messages:
                await self._handle(msg)

    def stop(self) -> None:
        self._running = False

    async def _handle(self, msg) -> None:
        try:
            command = decode_command(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            log.error("dropping undecodable command on %s: %s", msg.subject, error)
            await msg.term()
            return
        try:
            await self._on_command(command)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("command %s failed; it will be redelivered", command.command_id)
            await msg.nak(delay=1)
            return
        await msg.ack()
