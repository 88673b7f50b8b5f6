"""The runner's work, apart from its entry point (exo/runner/__main__.py): `Runner` reads requests
from the worker on stdin, serves them on one model thread (load, warm up, generate: alone or in a
batch; embeddings, transcriptions and speech in other_requests.py) and reports back on stdout (JSON
lines); `ChunkMaker` (chunks.py) turns one generation's output into the token chunks published on
exo.tokens.<command_id>, and `Replies` (replies.py) sends both.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import BinaryIO, TypeGuard, cast

from exo.bus.adapters import fetch_adapter
from exo.bus.chunk_signing import ChunkSigner
from exo.bus.connection import Connection
from exo.core.catalogue import is_vision_config
from exo.core.requests import FinishReason, rows_of
from exo.runner.adapter_rows import adapter_scoped
from exo.runner.batch import Batcher, BatchFailed, batchable, resident_adapters
from exo.runner.cache_contents import report_cache_contents
from exo.runner.choices import refusal
from exo.runner.chunks import ChunkMaker
from exo.runner.decoding import GenerationResult, OnOutput, Output, RequestRefused
from exo.runner.embed_batch import EmbedBatcher
from exo.runner.embedding_engine import EmbeddingEngine, embedding_spec_of
from exo.runner.engine import Engine
from exo.runner.engine_api import ModelEngine
from exo.runner.follower import follow
from exo.runner.other_requests import serve_embedding, serve_speech, serve_transcription
from exo.runner.prefill_split import PrefillSplit
from exo.runner.protocol import (
    Alive,
    AnyRequest,
    Cancel,
    ExpectPrefill,
    Failed,
    Generate,
    Load,
    Loaded,
    Shutdown,
    Started,
    WarmedUp,
    WarmUp,
    request_decoder,
)
from exo.runner.replies import Replies
from exo.runner.speech_engine import SpeechEngine, is_text_to_speech_model
from exo.runner.traces import GenerationTraces
from exo.runner.transcription_engine import TranscriptionEngine, is_speech_to_text_model
from exo.settings.services import RunnerSettings

PULSE_S = 1.0  # how often the runner tells the worker it is alive (protocol.Alive)
ADAPTER_FETCH_TIMEOUT_S = 600.0  # as the worker's: an adapter of a large model is hundreds of MB
WORKER_GONE_GRACE_S = 5.0  # stdin closed: the runner has exited by then, whatever its model thread does


class Runner:
    def __init__(self, nc: Connection, reports: BinaryIO, settings: RunnerSettings = RunnerSettings(),
                 signer: ChunkSigner | None = None) -> None:
        self._settings = settings
        self._engine: ModelEngine = Engine(settings)
        self._mlx_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx")
        self._cancelled: set[str] = set()  # written by the loop, read by the model thread between decode steps
        self._requests: asyncio.Queue[AnyRequest | None] = asyncio.Queue()  # None: the worker went away
        # How many requests decode together; 1 turns batching off. The default is mlx_lm.server's
        # --decode-concurrency: fewer costs throughput once more clients than that come.
        limit = settings.max_batch
        self._batcher = Batcher(self._engine, limit, self._mlx_thread) if limit > 1 else None
        self._embed_batcher: EmbedBatcher | None = None  # set when an embedding model is loaded
        self._generating: dict[str, asyncio.Task[None]] = {}  # batched generations in flight, by task id
        self._in_flight: set[str] = set()  # generations the model thread has not finished yet
        self._traces = GenerationTraces()  # the spans of traced requests (exo/telemetry); none otherwise
        self._nc = nc  # for the adapters a follower fetches (adapter_rows.py)
        self._replies = Replies(nc, reports, self._traces, lambda: self._engine.prompt_cache.stats(), signer)
        # Prefill on a prefill instance, decode here (or the other way round): exo/runner/prefill_split.py.
        self._split = PrefillSplit(self._engine, self._mlx_thread, signer, settings.prefill_timeout_s)
        self._model_id = ""  # the instance's (Load)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.create_task(self._read_stdin(loop))
        publisher = asyncio.create_task(self._replies.publish())
        pulse = asyncio.create_task(self._pulse())
        cache_reports = asyncio.create_task(report_cache_contents(lambda: self._engine.prompt_cache,
                                                                  self._replies.report))
        while True:
            request = await self._requests.get()
            if request is None or isinstance(request, Shutdown) or self._replies.worker_gone:
                break
            if self._batched(request) or self._embeds(request):  # alongside the next requests: they may join it
                self._start_batched(loop, request)
            else:  # in order: on the model thread it waits for the batch in progress to finish
                await self._serve(loop, request)
        if self._generating:
            # Cancelled generations end at their next step; with the worker gone, one blocked in a
            # collective whose peer went too never will: do not wait for it forever.
            grace = WORKER_GONE_GRACE_S if self._replies.worker_gone else None
            await asyncio.wait(list(self._generating.values()), timeout=grace)
        await self._leave_group(loop)
        await self._replies.all_sent()
        publisher.cancel()
        reader.cancel()
        pulse.cancel()
        cache_reports.cancel()
        await self._split.close()

    async def _pulse(self) -> None:
        """Alive every PULSE_S while idle or while the model thread has moved since the last one:
        a model thread stuck in a step (or a stopped process) goes quiet, and the worker acts. A prompt
        being tokenized (batch.py) is not the model thread's yet: that may take seconds without a step."""
        last = self._engine.pulse
        while True:
            await asyncio.sleep(PULSE_S)
            if not self._in_flight or self._engine.pulse != last or (self._batcher and self._batcher.preparing):
                self._replies.report(Alive())
            last = self._engine.pulse

    def _start_batched(self, loop: asyncio.AbstractEventLoop, request: Generate) -> None:
        task = asyncio.create_task(self._serve(loop, request))
        self._generating[request.task_id] = task
        task.add_done_callback(lambda _: self._generating.pop(request.task_id, None))

    def _follow(self, loop: asyncio.AbstractEventLoop) -> None:
        """A rank other than 0: from now on the model thread runs what rank 0 announces."""
        def on_end(done: asyncio.Future[None]) -> None:
            error = done.exception()
            self._replies.report(Failed(error=f"lost rank 0: {type(error).__name__}: {error}" if error else "rank 0 left"))

        def fetch(digest: str) -> bytes:  # on the model thread, with the loop free to do the I/O
            return asyncio.run_coroutine_threadsafe(fetch_adapter(self._nc, digest, ADAPTER_FETCH_TIMEOUT_S), loop).result()

        loop.run_in_executor(self._mlx_thread, follow, self._engine, fetch).add_done_callback(on_end)

    async def _leave_group(self, loop: asyncio.AbstractEventLoop) -> None:
        """Rank 0 tells the followers it is leaving; a follower cannot finish its thread, so it just exits."""
        lockstep = self._engine.lockstep
        if lockstep is None:
            return
        try:
            if lockstep.leads:
                try:
                    await asyncio.wait_for(loop.run_in_executor(self._mlx_thread, self._engine.release_followers), 5)
                except Exception:
                    logging.exception("could not tell the other ranks that rank 0 is leaving")
            await self._replies.all_sent()
            self._replies.flush_reports()  # raises if the worker is gone (its pipe closed)
        finally:
            os._exit(0)  # whatever happened: the model thread may be blocked in a collective that never ends

    def _choose_engine(self, model_path: str) -> None:
        """mlx-vlm for a vision-language checkpoint (one request at a time), an embedding engine for a
        model with sentence-transformers' pooling, else mlx-lm."""
        if is_vision_model(model_path):
            from exo.runner.vision_engine import VisionEngine  # mlx-vlm: imported only where it serves

            self._engine, self._batcher = VisionEngine(self._settings), None
        elif embedding_spec_of(model_path) is not None:
            engine = EmbeddingEngine(self._settings)
            self._engine, self._batcher = engine, None
            self._embed_batcher = EmbedBatcher(engine, self._mlx_thread)
        elif is_speech_to_text_model(model_path):
            self._engine, self._batcher = TranscriptionEngine(self._settings), None
        elif is_text_to_speech_model(model_path):
            self._engine, self._batcher = SpeechEngine(self._settings), None

    def _warm_up(self) -> None:
        """On the model thread: the paths this model's requests take (a quantized KV cache or a draft
        model keeps every request on the single path), so `ready` means the first one is fast."""
        self._engine.warm_up()
        if self._batcher is not None and not self._engine.kv_bits and self._engine.draft_model is None:
            self._batcher.warm_up()

    def _embeds(self, request: AnyRequest) -> TypeGuard[Generate]:
        return self._embed_batcher is not None and isinstance(request, Generate) and request.params.embed is not None

    def _batched(self, request: AnyRequest) -> TypeGuard[Generate]:
        # A quantized KV cache takes the single path, as in mlx_lm.server (the batch keeps full caches).
        # A resumed request too: its earlier tokens are prefilled on the single path (Engine.generate).
        # With a draft model every request takes it (the batch does not).
        return (self._batcher is not None and isinstance(request, Generate) and not self._engine.kv_bits
                and self._engine.draft_model is None
                and request.resume is None
                and batchable(request.params, request.image_paths, multi_node=self._engine.lockstep is not None))

    async def _serve(self, loop: asyncio.AbstractEventLoop, request: AnyRequest) -> None:
        try:
            if isinstance(request, Load):
                self._choose_engine(request.model_path)
                await loop.run_in_executor(self._mlx_thread, self._engine.load, request.model_path, request.shard,
                                           request.max_context, request.kv_bits, request.adapter_path)
                if request.draft_path:
                    await loop.run_in_executor(self._mlx_thread, self._engine.load_draft, request.draft_path,
                                               request.num_draft_tokens)
                self._model_id, self._split.engine = request.model_id, self._engine
                port = await self._split.serve(request.model_id) if request.serve_prefills else 0
                self._replies.report(Loaded(prefill_port=port))
            elif isinstance(request, WarmUp):
                started = time.perf_counter()
                await loop.run_in_executor(self._mlx_thread, self._warm_up)
                self._replies.report(WarmedUp(seconds=round(time.perf_counter() - started, 3)))
                if self._engine.lockstep is not None and not self._engine.lockstep.leads:
                    self._follow(loop)
            elif isinstance(request, Generate):
                with self._traces.generation(request):
                    await self._generate(loop, request)
        except Exception as error:  # a broken model must be reported, not kill silently
            traceback.print_exc()
            self._replies.report(Failed(error=f"{type(error).__name__}: {error}"))

    async def _generate(self, loop: asyncio.AbstractEventLoop, request: Generate) -> None:
        """By what the request asks for: vectors, a transcript or speech (other_requests.py), else text."""
        params = request.params
        if params.embed is not None:
            await serve_embedding(self._replies, self._embed_batcher, self._engine, self._in_flight, request.task_id,
                                  params.embed)
        elif params.transcribe is not None:
            await serve_transcription(self._replies, loop, self._mlx_thread, self._engine, request,
                                      self._cancelled)
        elif params.speak is not None:
            await serve_speech(self._replies, loop, self._mlx_thread, self._engine, request, self._cancelled)
        else:
            await self._generate_text(loop, request)

    async def _generate_text(self, loop: asyncio.AbstractEventLoop, request: Generate) -> None:
        task_id = request.task_id
        chunks = ChunkMaker(task_id, request.resume, self._settings.stream_interval_ms / 1000)
        if task_id in self._cancelled:
            await self._replies.finish(task_id, chunks.index, reason="cancelled", prompt=0, completion=0, attempt=chunks.attempt)
            return

        def on_output(out: Output) -> None:  # on the model thread
            for chunk in chunks.add(out, time.perf_counter()):
                loop.call_soon_threadsafe(self._replies.send, chunk)

        if request.prefill is not None and request.resume is None:
            await self._split.fetch_into_cache(request, self._model_id)  # the prompt's cache, from a prefill instance
        running = self._start(loop, request, self._traces.watching(task_id, on_output))
        self._replies.report(Started(task_id=task_id))  # after the model thread has its work: off the first token's path
        self._in_flight.add(task_id)
        self._engine.beat()  # waiting for the model thread counts from here
        try:
            result = await running
        except Exception as error:
            self._in_flight.discard(task_id)
            if isinstance(error, RequestRefused):  # the client's mistake, refused before any collective
                await self._replies.finish(task_id, chunks.index, "error", 0, 0, error=str(error),
                                           error_code=error.code, attempt=chunks.attempt)
                return
            traceback.print_exc()
            if self._engine.lockstep is not None and (isinstance(error, BatchFailed) or not self._batched(request)):
                # The group broke (a peer's machine may be gone): the worker ends the task, or the master
                # moves it to another instance first (exo/master/heal.py); no error chunk from here.
                # The other ranks may still wait in a collective of this step: only a new group is sure to be in step.
                self._replies.report(Failed(error=f"{type(error).__name__}: {error}"))
                return
            await self._replies.finish(task_id, chunks.index, "error", 0, 0,
                                       error=f"{type(error).__name__}: {error}", attempt=chunks.attempt)
            return
        self._in_flight.discard(task_id)
        for rest in chunks.rest(result, time.perf_counter()):  # on the loop thread, after every chunk the model thread scheduled
            self._replies.send(rest)
        # GenerationResult's reason is a str: mlx-lm's "stop" or "length", or Decoding's "cancelled".
        reason = cast(FinishReason, result.finish_reason)
        await self._replies.finish(task_id, chunks.index, reason, result.prompt_tokens, result.completion_tokens,
                                   stop_sequence=result.stop_sequence, cached=result.cached_tokens,
                                   attempt=chunks.attempt, draft=result.draft_tokens,
                                   choices=chunks.untold(result.choices))

    def _start(self, loop: asyncio.AbstractEventLoop, request: Generate,
               on_output: OnOutput) -> Awaitable[GenerationResult]:
        """Hands the generation to the model thread: into the batch, or alone (Engine.generate)."""
        task_id = request.task_id

        def is_cancelled() -> bool:
            return task_id in self._cancelled

        on_start = self._traces.started(task_id)
        params, adapter_path = adapter_scoped(request.params, request.adapter_path), request.adapter_path
        if self._batcher is not None and self._batched(request):
            return self._batcher.run(loop, params, request.defaults, on_output, is_cancelled, task_id, on_start,
                                     adapter_path)
        images = [request.image_paths[digest] for message in request.params.messages for digest in message.images]

        def generate_alone() -> GenerationResult:
            if rows_of(request.params) > 1:  # several choices fan out in the batch only (choices.py)
                raise refusal(resumed=request.resume is not None)
            if on_start is not None:
                on_start()
            adapters = resident_adapters(self._engine)
            if adapter_path and adapters is None:
                raise RequestRefused("this model takes no LoRA adapter per request")
            with adapters.alone(self._engine.model, adapter_path, task_id) if adapters else nullcontext():
                return self._engine.generate(params, request.defaults, on_output, is_cancelled, task_id, None,
                                             images, request.resume)
        return loop.run_in_executor(self._mlx_thread, generate_alone)

    async def _read_stdin(self, loop: asyncio.AbstractEventLoop) -> None:
        # Read on the event loop itself (not a thread): one thread hop less per request.
        stdin = asyncio.StreamReader(limit=64 * 1024 * 1024)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin.buffer)
        while line := await stdin.readline():
            request = request_decoder.decode(line)
            if isinstance(request, Cancel):
                self._cancelled.add(request.task_id)  # the model thread sees it at its next decode step
            elif isinstance(request, ExpectPrefill):
                self._split.expect(request)
            else:
                self._requests.put_nowait(request)
        self._on_worker_gone()

    def _on_worker_gone(self) -> None:
        """The worker (the node's exo process) is gone, killed or crashed: its tasks move to other
        instances (exo/master/heal.py). Every generation here stops at its next step without a last
        chunk, and the runner exits within WORKER_GONE_GRACE_S even if its model thread never returns
        (a collective whose peer went too): nobody is left to stop it and free its memory."""
        self._replies.worker_gone = True
        self._cancelled.update(self._in_flight, self._generating)
        self._requests.put_nowait(None)
        exit_anyway = threading.Timer(WORKER_GONE_GRACE_S, os._exit, (0,))
        exit_anyway.daemon = True
        exit_anyway.start()


def is_vision_model(model_path: str) -> bool:
    try:
        return is_vision_config(json.loads((Path(model_path) / "config.json").read_text()))
    except (OSError, ValueError):
        return False
