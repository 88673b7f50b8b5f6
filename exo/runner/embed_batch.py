"""Embedding requests share forward passes: those that arrive while one pass runs wait for it, then
go through together (exo/runner/embedding_engine.py pads them into common batches). Called on the
event loop; the passes run on the model thread."""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from exo.core.requests import EmbedInputs
from exo.runner.decoding import RequestRefused
from exo.runner.embedding_engine import Embedded, EmbeddingEngine

MAX_INPUTS_TOGETHER = 256  # inputs of the requests taken into one round (each request whole)


class EmbedBatcher:
    def __init__(self, engine: EmbeddingEngine, model_thread: Executor) -> None:
        self._engine = engine
        self._model_thread = model_thread
        self._waiting: list[tuple[EmbedInputs, asyncio.Future[Embedded]]] = []
        self._draining = False
        self.rounds = 0  # forward rounds run, for tests and /metrics

    def embed(self, inputs: EmbedInputs) -> asyncio.Future[Embedded]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Embedded] = loop.create_future()
        self._waiting.append((inputs, future))
        if not self._draining:
            self._draining = True
            loop.create_task(self._drain(loop))
        return future

    async def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            while self._waiting:
                taken = self._take()
                self.rounds += 1
                try:
                    answers = await loop.run_in_executor(self._model_thread, self._engine.embed_together,
                                                         [inputs for inputs, _ in taken])
                except Exception as error:  # the pass itself failed: every request of it fails with it
                    for _, future in taken:
                        if not future.done():
                            future.set_exception(error)
                    continue
                for (_, future), answer in zip(taken, answers, strict=True):
                    if future.done():
                        continue
                    if isinstance(answer, RequestRefused):
                        future.set_exception(answer)
                    else:
                        future.set_result(answer)
        finally:
            self._draining = False

    def _take(self) -> list[tuple[EmbedInputs, asyncio.Future[Embedded]]]:
        """The oldest waiting requests, up to MAX_INPUTS_TOGETHER inputs (at least one request)."""
        taken: list[tuple[EmbedInputs, asyncio.Future[Embedded]]] = []
        inputs = 0
        while self._waiting:
            size = len(self._waiting[0][0].texts) + len(self._waiting[0][0].token_ids)
            if taken and inputs + size > MAX_INPUTS_TOGETHER:
                break
            taken.append(self._waiting.pop(0))
            inputs += size
        return taken
