"""Commands to the master: the EXO_COMMANDS stream and the master's durable pull consumer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.client import JetStreamContext

from exo.bus.errors import raise_if_cancelled
from exo.bus.publish import publish_durably
from exo.bus.subjects import MASTER_CONSUMER, SHARED, LogNames
from exo.core.commands import AnyCommand, Command, command_tag, decode_command, encode_command
from exo.telemetry import tracing

log = logging.getLogger(__name__)

OnCommand = Callable[[AnyCommand], Awaitable[None]]
OnPoison = Callable[[AnyCommand, str], Awaitable[None]]
Confirm = Callable[[], Awaitable[None]]  # raises NotLeader when the batch's events do not count

# Commands taken per fetch: those already waiting, no more. Deciding a batch costs one wait for
# State to fold its events and one ack round, not one per command (docs/scaling.md).
BATCH = 64
BEHIND_TIMEOUT_S = 3.0  # fetching the commands queued behind the first (see _waiting_commands)

# A command whose handling failed this many times is answered with an error and dropped: a bug
# must not loop one command forever (the consumer itself allows any number of deliveries).
MAX_COMMAND_ATTEMPTS = 3
RETRY_DELAY_S = 1.0


class NotLeader(Exception):
    """The master lost its lease while handling a command: leave the command to the next one."""


class RetryBatch(Exception):
    """The batch's events were refused as a whole, none stored: decide its commands again, now
    (the master then appends one command's events at a time, so a bad one is answered alone)."""


async def send_command(nc: Client, command: Command, names: LogNames = SHARED) -> None:
    """Durably queue a command (for the shared master, or a master group's); Nats-Msg-Id makes a
    retried send harmless."""
    subject = names.command_subject(command_tag(command))
    with tracing.span("exo.command.send", kind="producer", attributes={"exo.command": command_tag(command)}) as sending:
        await publish_durably(nc, subject, encode_command(command), names.commands_stream, command.command_id,
                              traceparent=sending.traceparent)


async def consume_commands(nc: Client, on_command: OnCommand, still_leader: Callable[[], bool],
                           on_poison: OnPoison | None = None, confirm: Confirm | None = None,
                           names: LogNames = SHARED) -> None:
    """Pull commands while `still_leader()`, as many as are waiting (up to BATCH) at a time, and
    handle them in order. A command is acked only after `on_command` returned and then `confirm()`
    did (once per batch: State holds the batch's events and this master still leads), so one that
    a dying or deposed master held is redelivered to the next. One whose handling keeps failing
    goes to `on_poison` (which answers its caller) after MAX_COMMAND_ATTEMPTS."""
    subscription = await nc.jetstream().pull_subscribe_bind(MASTER_CONSUMER, stream=names.commands_stream)
    try:
        while still_leader():
            try:
                messages = await _waiting_commands(subscription)
            except (TimeoutError, NatsTimeout):  # nothing waiting; nats-py's batch fetch can raise the bare one
                raise_if_cancelled()  # a cancellation that met the fetch's timeout comes out as one (Python 3.11)
                continue
            except NatsError as error:  # a reconnect or a stream leader change: ask again
                raise_if_cancelled()
                log.info("fetching commands: %r", error)
                await asyncio.sleep(0.5)
                continue
            if not await _handle_batch(messages, on_command, still_leader, on_poison, confirm):
                return
    finally:
        with contextlib.suppress(TimeoutError, NatsError):  # bounded: a fetch cancelled mid-request must not hold up shutdown
            await asyncio.wait_for(subscription.unsubscribe(), 5)


async def _waiting_commands(subscription: JetStreamContext.PullSubscription) -> list[Msg]:
    """The next command (waiting up to 1 s for one), then those already queued behind it, up to BATCH.

    Not one fetch of BATCH: nats-py can keep a batch's pull request open until the batch is full or
    the request expires, so on an idle cluster a lone command waited up to a second for company
    (bench/embeddings.py saw it). The first message says how many wait behind it (num_pending):
    those are fetched at once, and the server has them to deliver."""
    first = await subscription.fetch(batch=1, timeout=1)
    behind = min(BATCH - 1, first[-1].metadata.num_pending or 0)
    if behind <= 0:
        return first
    try:
        # The server answers this fetch at once (no_wait): the timeout only bounds a slow round trip,
        # and at 1 s a starved machine split batches that were all waiting (tests/test_atomic_batches.py).
        return first + await subscription.fetch(batch=behind, timeout=BEHIND_TIMEOUT_S)
    except (TimeoutError, NatsTimeout):  # taken meanwhile: decide the first alone
        return first


async def _handle_batch(messages: list[Msg], on_command: OnCommand, still_leader: Callable[[], bool],
                        on_poison: OnPoison | None, confirm: Confirm | None) -> bool:
    """False when this master must stop consuming; what it did not settle goes back (nak)."""
    handled: list[Msg] = []
    done = 0  # messages handled or settled so far
    keep_going = True
    try:
        for msg in messages:
            outcome = await _handle(msg, on_command, still_leader, on_poison)
            done += 1
            if outcome == "handled":
                handled.append(msg)
            elif outcome == "stop":
                keep_going = False
                break
        await _nak_all(messages[done:])
        if handled and confirm is not None:
            await confirm()
    except NotLeader:
        await _nak_all(handled)
        return False
    except RetryBatch:
        await _nak_all(handled)
        return keep_going
    except Exception:
        # The broker failed under us (a nak, a wait for State): the rest goes back now, not after the ack wait.
        await _nak_all(handled + messages[done:])
        raise
    for msg in handled:
        await msg.ack()
    return keep_going


async def _nak_all(messages: list[Msg]) -> None:
    for msg in messages:
        with contextlib.suppress(NatsError):  # the connection is away: the server redelivers after its ack wait anyway
            await msg.nak()


async def _handle(msg: Msg, on_command: OnCommand, still_leader: Callable[[], bool], on_poison: OnPoison | None) -> str:
    """"handled" (ack it once the batch is confirmed), "settled" (acked, nak'ed or dropped here) or
    "stop" (this master must stop consuming)."""
    if not still_leader():
        await msg.nak()
        return "stop"
    try:
        command = decode_command(msg.data)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        log.error("dropping undecodable command on %s: %s", msg.subject, error)
        await msg.term()
        return "settled"
    try:
        with tracing.span("exo.master.decide", tracing.traceparent_of(msg.headers), "consumer",
                          {"exo.command": command_tag(command), "exo.command_id": command.command_id}):
            await on_command(command)
    except asyncio.CancelledError:
        raise
    except NotLeader:
        await msg.nak()
        return "stop"
    except Exception as error:
        attempts = msg.metadata.num_delivered
        if on_poison is None or attempts < MAX_COMMAND_ATTEMPTS:
            log.exception("command %s failed (attempt %d); it will be redelivered", command.command_id, attempts)
            await msg.nak(delay=RETRY_DELAY_S)
            return "settled"
        log.exception("command %s failed %d times; answering it with the error", command.command_id, attempts)
        return "settled" if await _give_up(msg, command, f"{type(error).__name__}: {error}", on_poison) else "stop"
    return "handled"


async def _give_up(msg: Msg, command: AnyCommand, error: str, on_poison: OnPoison) -> bool:
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
