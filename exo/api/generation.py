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
from exo.core.events import TaskFinished
from exo.core.types import GenerationParams, TokenChunk

log = logging.getLogger(__name__)


# A task can end without a last chunk from its runner (its instance was deleted before it
# ran); once State says it ended, the chunk that may still be in flight gets this long.
TASK_END_GRACE_S = 1.0


class Generation:
    """A running generation: iterate its chunks; `close()` cancels it if it has not finished."""

    def __init__(self, ctx: ApiContext, command_id: str, listener: TokenListener, ended: asyncio.Future[TaskFinished]) -> None:
        self.command_id = command_id
        self._ctx = ctx
        self._listener = listener
        self._ended = ended
        self.finished = False

    async def chunks(self) -> AsyncIterator[TokenChunk]:
        while not self.finished:
            chunk = await self._next_chunk()
            self.finished = chunk.finish_reason is not None
            yield chunk

    async def _next_chunk(self) -> TokenChunk:
        queue = self._listener.queue
        if not queue.empty() or not self._ended.done():
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait({getter, self._ended}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                return getter.result()
            getter.cancel()
        try:
            return await asyncio.wait_for(queue.get(), TASK_END_GRACE_S)
        except asyncio.TimeoutError:
            end = self._ended.result()
            reason = "error" if end.status == "failed" else "cancelled"
            return TokenChunk(command_id=self.command_id, index=-1, finish_reason=reason, error=end.error or f"task {end.status}")

    async def close(self) -> None:
        self._ctx.outcomes.forget_task_end(self.command_id)
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
    ended = ctx.outcomes.expect_task_end(command_id)
    try:
        await send_command(ctx.nc, GenerateText(command_id=command_id, model_id=model_id, params=params, at=time.time()))
        raise_if_rejected(await asyncio.wait_for(answer, COMMAND_TIMEOUT_S))
    except asyncio.TimeoutError:
        ctx.outcomes.forget_task_end(command_id)
        await listener.close()
        raise ApiError(504, "the master did not answer in time; is it running?") from None
    except BaseException:
        ctx.outcomes.forget_task_end(command_id)
        await listener.close()
        raise
    finally:
        ctx.outcomes.forget(command_id)
    return Generation(ctx, command_id, listener, ended)
