"""The runner's requests that generate no text: embeddings (embed_batch.py), a transcription
(transcription_engine.py) and speech (speech_engine.py). Each is reported Started, publishes its
chunks and ends in one final chunk, as a generation does (process.py serves those)."""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from exo.core.ids import TaskId
from exo.core.requests import EmbedInputs, TokenChunk
from exo.runner.embed_batch import EmbedBatcher
from exo.runner.engine_api import ModelEngine
from exo.runner.protocol import Generate, Started
from exo.runner.replies import Replies
from exo.runner.speech_engine import SpeechChunks, speak
from exo.runner.transcription_engine import TranscriptionEngine, transcript_chunks


async def serve_embedding(replies: Replies, batcher: EmbedBatcher | None, engine: ModelEngine,
                          in_flight: set[str], task_id: TaskId, inputs: EmbedInputs) -> None:
    """One vector per input, each in a chunk of its own (index = the input's), then the final chunk."""
    replies.report(Started(task_id=task_id))
    if batcher is None:
        await replies.finish(task_id, 0, "error", 0, 0, error="this model does not embed: it has no pooling "
                             "(sentence-transformers' modules.json)", error_code="invalid_request_error")
        return
    in_flight.add(task_id)
    engine.beat()
    try:
        embedded = await batcher.embed(inputs)
    except Exception as error:
        await replies.fail(task_id, error)
        return
    finally:
        in_flight.discard(task_id)
    for index, vector in enumerate(embedded.vectors):
        replies.send(TokenChunk(command_id=task_id, index=index, embedding=vector))
    await replies.finish(task_id, len(embedded.vectors), "stop", embedded.prompt_tokens, 0)


async def serve_speech(replies: Replies, loop: asyncio.AbstractEventLoop, model_thread: Executor,
                       engine: ModelEngine, request: Generate, cancelled: set[str]) -> None:
    """The speech in chunks as the model makes it (speech_engine.py), then the final chunk. Not
    counted in flight, as a transcription: a segment may take long, and beats only at its end."""
    task_id = request.task_id
    replies.report(Started(task_id=task_id))
    chunks = SpeechChunks(task_id, lambda chunk: loop.call_soon_threadsafe(replies.send, chunk))
    try:
        spoken = await loop.run_in_executor(model_thread, speak, engine, request.params.speak, chunks,
                                            lambda: task_id in cancelled)
    except Exception as error:
        await replies.fail(task_id, error, chunks.index)
        return
    await replies.finish(task_id, chunks.index, "cancelled" if spoken.cancelled else "stop", spoken.input_tokens,
                         spoken.tokens, audio_seconds=spoken.seconds)


async def serve_transcription(replies: Replies, loop: asyncio.AbstractEventLoop, model_thread: Executor,
                              engine: ModelEngine, request: Generate, cancelled: set[str]) -> None:
    """The segments and the whole text in chunks (transcript_chunks), then the final chunk; a
    cancel stops it before Whisper's next 30-second window. Not counted in flight: a window may take
    long, and beats only as it starts."""
    task_id, inputs = request.task_id, request.params.transcribe
    assert inputs is not None
    replies.report(Started(task_id=task_id))
    audio = request.image_paths.get(inputs.audio)
    if not isinstance(engine, TranscriptionEngine):
        await replies.finish(task_id, 0, "error", 0, 0, error="this model does not turn speech into text",
                             error_code="invalid_request_error")
        return
    if audio is None:  # the worker hands every task its objects: this is exo's fault, not the client's
        await replies.finish(task_id, 0, "error", 0, 0, error="the task's audio was not handed to the runner")
        return
    try:
        done = await loop.run_in_executor(model_thread, engine.transcribe, inputs, audio,
                                          lambda: task_id in cancelled)
    except Exception as error:
        await replies.fail(task_id, error)
        return
    if done is None:
        await replies.finish(task_id, 0, "cancelled", 0, 0)
        return
    chunks = transcript_chunks(task_id, done)
    for chunk in chunks:
        replies.send(chunk)
    await replies.finish(task_id, len(chunks), "stop", 0, done.tokens)
