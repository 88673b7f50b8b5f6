"""The one request path into the cluster for text generation, shared by every API surface."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

from exo.api.context import ApiContext
from exo.api.errors import ApiError
from exo.api.outcomes import COMMAND_TIMEOUT_S, raise_if_rejected
from exo.bus.command_queue import send_command
from exo.bus.tokens import TokenListener
from exo.core.commands import CancelTask, GenerateText
from exo.core.types import GenerationParams, TokenChunk

log = logging.getLogger(__name__)


class Generation:
    """A running generation: iterate its chunks; `close()` cancels it if it has not finished."""

    def __init__(self, ctx: ApiContext, command_id: str, listener: TokenListener) -> None:
        self.command_id = command_id
        self._ctx = ctx
        self._listener = listener
        self.finished = False

    async def chunks(self) -> AsyncIterator[TokenChunk]:
        while not self.finished:
            chunk = await self._listener.queue.get()
            self.finished = chunk.finish_reason is not None
            yield chunk

    async def close(self) -> None:
        await self._listener.close()
        if not self.finished:
            # The caller went away: stop the runner within one decode step.
            cancel = CancelTask(command_id=uuid.uuid4().hex, task_id=self.command_id)
            await asyncio.shield(send_command(self._ctx.nc, cancel))


async def start_generation(ctx: ApiContext, model_id: str, params: GenerationParams) -> Generation:
    """Queue the request and return once the master accepted it (or raise why it did not)."""
    command_id = uuid.uuid4().hex
    listener = await TokenListener.live(ctx.nc, command_id)  # before sending: no chunk can be missed
    answer = ctx.outcomes.expect(command_id)
    try:
        await send_command(ctx.nc, GenerateText(command_id=command_id, model_id=model_id, params=params, at=time.time()))
        raise_if_rejected(await asyncio.wait_for(answer, COMMAND_TIMEOUT_S))
    except asyncio.TimeoutError:
        await listener.close()
        raise ApiError(504, "the master did not answer in time; is it running?") from None
    except BaseException:
        await listener.close()
        raise
    finally:
        ctx.outcomes.forget(command_id)
    return Generation(ctx, command_id, listener)
