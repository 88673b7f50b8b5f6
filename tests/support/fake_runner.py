"""A runner with no model, for the scale simulator: the worker's other RunnerLink.

Load and warm-up are answered at once. Each generation waits `delay_s` (the model's time, which
the simulator subtracts from what it measures), then publishes `chunks` token chunks through
the real ChunkPublisher (every one acked by EXO_TOKENS, as a real runner's) and reports Done.
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client

from exo.bus.token_publisher import ChunkPublisher
from exo.core.ids import RunnerId, TaskId
from exo.core.requests import FinishReason, TokenChunk
from exo.runner import protocol as rp
from exo.worker.runner_host import OnExit, OnReport


class FakeRunner:
    def __init__(self, runner_id: RunnerId, nc: Client, delay_s: float = 0.005, chunks: int = 4) -> None:
        self.runner_id = runner_id
        self._nc = nc
        self._delay_s = delay_s
        self._chunks = chunks
        self._publisher = ChunkPublisher(nc)
        self._cancelled: set[TaskId] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._on_report: OnReport | None = None

    async def start(self, on_report: OnReport, on_exit: OnExit) -> None:
        self._on_report = on_report
        await self._publisher.start()

    async def send(self, request: rp.Request) -> None:
        match request:
            case rp.Load():
                await self._report(rp.Loaded())
            case rp.WarmUp():
                await self._report(rp.WarmedUp())
            case rp.Generate():
                task = asyncio.create_task(self._generate(request.task_id))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            case rp.Cancel():
                self._cancelled.add(request.task_id)

    async def stop(self, timeout: float = 5.0) -> None:
        self.kill()

    def kill(self) -> None:
        for task in self._tasks:
            task.cancel()
        asyncio.get_running_loop().create_task(self._publisher.close())

    async def _generate(self, task_id: TaskId) -> None:
        await self._report(rp.Started(task_id=task_id))
        await asyncio.sleep(self._delay_s)
        sent = 0
        for index in range(self._chunks):
            if task_id in self._cancelled:
                break
            await self._publisher.publish(TokenChunk(command_id=task_id, index=index, text=f"t{index} ",
                                                     token_count=index + 1, prompt_tokens=8))
            sent += 1
        reason: FinishReason = "cancelled" if task_id in self._cancelled else "length"
        await self._publisher.publish(TokenChunk(command_id=task_id, index=sent, token_count=sent, prompt_tokens=8,
                                                 finish_reason=reason))
        await self._report(rp.Done(task_id=task_id, finish_reason=reason, prompt_tokens=8, completion_tokens=sent))

    async def _report(self, report: rp.AnyReport) -> None:
        assert self._on_report is not None
        await self._on_report(report)
