"""What a runner sends back: its reports to the worker (JSON lines on stdout, protocol.py) and each
task's token chunks on exo.tokens.<task id>, in order through one publisher. A task's Done goes
to the worker only once its final chunk is out."""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import Callable
from typing import BinaryIO

from exo.bus.chunk_signing import ChunkSigner
from exo.bus.connection import Connection
from exo.bus.token_publisher import ChunkPublisher
from exo.core.ids import TaskId
from exo.core.requests import ChoiceEnd, FinishReason, TokenChunk
from exo.core.types import PromptCacheStats
from exo.runner.decoding import RequestRefused
from exo.runner.protocol import Done, Report, encode_line
from exo.runner.traces import GenerationTraces

# What the publisher sends: a chunk, or a generation's final chunk with the future set once it is out.
Outgoing = TokenChunk | tuple[TokenChunk, asyncio.Future[None]]


class Replies:
    def __init__(self, nc: Connection, reports: BinaryIO, traces: GenerationTraces,
                 prompt_cache_stats: Callable[[], PromptCacheStats], signer: ChunkSigner | None = None) -> None:
        self._nc = nc
        self._signer = signer  # its node's key, which every chunk is signed with
        self._reports = reports
        self._traces = traces
        self._prompt_cache_stats = prompt_cache_stats  # of the engine loaded now
        self._chunks: asyncio.Queue[Outgoing] = asyncio.Queue()
        self.worker_gone = False  # stdin closed: the node's exo process is gone (Runner._on_worker_gone)

    def report(self, message: Report) -> None:
        if self.worker_gone:
            return  # nobody reads the pipe any more
        self._reports.write(encode_line(message))
        self._reports.flush()

    def flush_reports(self) -> None:
        self._reports.flush()  # raises if the worker is gone (its pipe closed)

    def send(self, chunk: TokenChunk) -> None:
        self._chunks.put_nowait(chunk)

    async def all_sent(self) -> None:
        await self._chunks.join()

    async def finish(self, task_id: TaskId, index: int, reason: FinishReason, prompt: int, completion: int,
                     error: str = "", stop_sequence: str = "", cached: int = 0, error_code: str = "",
                     attempt: int = 0, draft: int = 0, choices: list[ChoiceEnd] | None = None,
                     audio_seconds: float = 0.0) -> None:
        """A task's final chunk (`index`: the chunks it published before), then its Done."""
        if self.worker_gone:
            return  # the task moves on elsewhere: a last chunk from here would end the client's stream
        final = TokenChunk(
            command_id=task_id, index=index, token_count=completion, prompt_tokens=prompt, finish_reason=reason,
            error=error, stop_sequence=stop_sequence, cached_tokens=cached, error_code=error_code, attempt=attempt,
            draft_tokens=draft, choices=choices or [],
        )
        published: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._chunks.put_nowait((final, published))
        await published  # this generation's chunks are all out (one publisher, in order); others may still run
        self.report(Done(task_id=task_id, finish_reason=reason, prompt_tokens=prompt, completion_tokens=completion,
                         error=error, cached_tokens=cached, prompt_cache=self._prompt_cache_stats(),
                         audio_seconds=audio_seconds))

    async def fail(self, task_id: TaskId, error: Exception, index: int = 0) -> None:
        """End a task by its exception: the client's mistake (RequestRefused: a 400 with its code) or a
        fault of this runner (its traceback on stderr). `index`: the chunks it published before."""
        if isinstance(error, RequestRefused):
            await self.finish(task_id, index, "error", 0, 0, error=str(error), error_code=error.code)
            return
        traceback.print_exception(error)
        await self.finish(task_id, index, "error", 0, 0, error=f"{type(error).__name__}: {error}")

    async def publish(self) -> None:
        # One publisher keeps chunks in order on the wire; each is acked by JetStream (resent if not).
        publisher = ChunkPublisher(self._nc, self._signer)
        await publisher.start()
        while True:
            chunk = await self._chunks.get()
            chunk, published = chunk if isinstance(chunk, tuple) else (chunk, None)
            try:
                await publisher.publish(chunk, self._traces.publishing(chunk.command_id))
            except Exception:
                logging.exception("cannot publish a token chunk")
            finally:
                self._chunks.task_done()
                if published is not None and not published.done():
                    published.set_result(None)
