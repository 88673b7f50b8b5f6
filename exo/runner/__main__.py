"""A runner: a subprocess that serves one instance's model with mlx-lm.

stdin carries requests from the worker and stdout carries reports back (JSON lines); text
goes straight to NATS on exo.tokens.<command_id>. Everything else the libraries print is
sent to stderr so it cannot corrupt the protocol.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

from exo import event_loop
from exo.bus.connection import connect, split_urls
from exo.bus.tokens import publish_chunk
from exo.core.types import TokenChunk
from exo.runner.coalesce import Coalescer
from exo.runner.engine import Engine, Output
from exo.runner.protocol import (
    Cancel, Done, Failed, Generate, Load, Loaded, Report, Shutdown, Started, WarmedUp, WarmUp,
    encode_line, request_decoder,
)

# Text that comes faster than this is sent in one message per interval (see coalesce.py).
STREAM_INTERVAL_S = float(os.environ.get("EXO_STREAM_INTERVAL_MS", "20")) / 1000


class Runner:
    def __init__(self, nc, reports) -> None:
        self._nc = nc
        self._reports = reports
        self._engine = Engine()
        self._mlx_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx")
        self._cancelled: set[str] = set()  # written by the loop, read by the model thread between decode steps
        self._requests: asyncio.Queue = asyncio.Queue()
        self._chunks: asyncio.Queue = asyncio.Queue()

    def report(self, message: Report) -> None:
        self._reports.write(encode_line(message))
        self._reports.flush()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.create_task(self._read_stdin(loop))
        publisher = asyncio.create_task(self._publish_chunks())
        while True:
            request = await self._requests.get()
            if request is None or isinstance(request, Shutdown):
                break
            await self._serve(loop, request)
        await self._chunks.join()
        publisher.cancel()
        reader.cancel()

    async def _serve(self, loop, request) -> None:
        try:
            if isinstance(request, Load):
                await loop.run_in_executor(self._mlx_thread, self._engine.load, request.model_path)
                self.report(Loaded())
            elif isinstance(request, WarmUp):
                await loop.run_in_executor(self._mlx_thread, self._engine.warm_up)
                self.report(WarmedUp())
            elif isinstance(request, Generate):
                await self._generate(loop, request)
        except Exception as error:  # a broken model must be reported, not kill silently
            traceback.print_exc()
            self.report(Failed(error=f"{type(error).__name__}: {error}"))

    async def _generate(self, loop, request: Generate) -> None:
        task_id = request.task_id
        if task_id in self._cancelled:
            await self._finish(task_id, index=0, reason="cancelled", prompt=0, completion=0)
            return
        index = 0
        coalescer = Coalescer(STREAM_INTERVAL_S)
        held = Output("", 0, 0, [], [])  # logprobs and tool calls ride with the text they came with

        def chunk_of(text: str, completion: int, prompt: int) -> TokenChunk:
            nonlocal index
            index += 1
            logprobs, tool_calls, held.logprobs, held.tool_calls = held.logprobs, held.tool_calls, [], []
            return TokenChunk(command_id=task_id, index=index - 1, text=text, token_count=completion, prompt_tokens=prompt,
                              logprobs=logprobs, tool_calls=tool_calls)

        def on_output(out: Output) -> None:  # on the model thread
            held.logprobs.extend(out.logprobs)
            held.tool_calls.extend(out.tool_calls)
            now = time.perf_counter()
            # A tool call is sent at once, with any text held before it.
            ready = (coalescer.flush(now) or "") if out.tool_calls else coalescer.add(out.text, now)
            if ready or out.tool_calls:
                loop.call_soon_threadsafe(self._chunks.put_nowait, chunk_of(ready or "", out.completion_tokens, out.prompt_tokens))

        running = loop.run_in_executor(
            self._mlx_thread, self._engine.generate, request.params, request.defaults, on_output,
            lambda: task_id in self._cancelled, task_id,
        )
        self.report(Started(task_id=task_id))  # after the model thread has its work: off the first token's path
        try:
            result = await running
        except Exception as error:
            traceback.print_exc()
            await self._finish(task_id, index, "error", 0, 0, error=f"{type(error).__name__}: {error}")
            return
        rest = coalescer.flush(time.perf_counter())
        if rest or held.logprobs:  # on the loop thread, after every chunk the model thread scheduled
            self._chunks.put_nowait(chunk_of(rest or "", result.completion_tokens, result.prompt_tokens))
        await self._finish(task_id, index, result.finish_reason, result.prompt_tokens, result.completion_tokens,
                           stop_sequence=result.stop_sequence)

    async def _finish(self, task_id, index, reason, prompt, completion, error: str = "", stop_sequence: str = "") -> None:
        final = TokenChunk(
            command_id=task_id, index=index, token_count=completion, prompt_tokens=prompt,
            finish_reason=reason, error=error, stop_sequence=stop_sequence,
        )
        self._chunks.put_nowait(final)
        await self._chunks.join()
        self.report(Done(task_id=task_id, finish_reason=reason, prompt_tokens=prompt, completion_tokens=completion, error=error))

    async def _publish_chunks(self) -> None:
        # One publisher keeps chunks in order on the wire.
        while True:
            chunk = await self._chunks.get()
            try:
                await publish_chunk(self._nc, chunk)
            except Exception:
                logging.exception("cannot publish a token chunk")
            finally:
                self._chunks.task_done()

    async def _read_stdin(self, loop) -> None:
        # Read on the event loop itself (not a thread): one thread hop less per request.
        stdin = asyncio.StreamReader(limit=64 * 1024 * 1024)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin.buffer)
        while line := await stdin.readline():
            request = request_decoder.decode(line)
            if isinstance(request, Cancel):
                self._cancelled.add(request.task_id)  # the model thread sees it at its next decode step
            else:
                self._requests.put_nowait(request)
        self._requests.put_nowait(None)  # the worker went away


async def _main() -> None:
    reports = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # library prints now land on stderr
    nc = await connect(split_urls(os.environ["EXO_RUNNER_NATS"]), name="exo-runner")
    try:
        await Runner(nc, reports).run()
    finally:
        await nc.drain()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    event_loop.run(_main())
