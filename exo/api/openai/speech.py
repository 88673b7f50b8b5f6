"""POST /v1/audio/speech in OpenAI's shape: `model`, `input`, `voice`, `response_format`, `speed`,
`stream_format`; the speech streams out as the runner makes it (exo/runner/speech_engine.py).

Formats are those exo encodes without ffmpeg (exo does not ship it): `wav` (16-bit mono, its header
sent first, with the sizes a stream cannot know yet), `pcm` (the same samples, no header) and `flac`
(exo/api/flac.py). mp3, opus and aac are a 400 naming `response_format`. With no
`response_format` the answer is WAV, not OpenAI's default mp3: Open WebUI sends none, and plays WAV.
Audio is at the model's own sample rate (Soprano 32 kHz, Kokoro 24 kHz: OpenAI's pcm is 24 kHz),
which the `X-Sample-Rate` header says. `stream_format: "sse"` sends OpenAI's events instead:
`speech.audio.delta` (the format's bytes, base64) and `speech.audio.done` with the usage.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator

import msgspec
from aiohttp import web

from exo.api.collect import raise_if_failed
from exo.api.context import ApiContext, context_of
from exo.api.errors import ApiError
from exo.api.flac import FlacEncoder
from exo.api.generation import Generation, generating
from exo.api.keep_alive import keep_alive_seconds
from exo.api.request_body import decode_body
from exo.api.sse import SseStream
from exo.core.ids import ModelId
from exo.core.requests import GenerationParams, SpeakInputs, TokenChunk

RESPONSE_FORMATS = ("wav", "pcm", "flac")
NEEDS_FFMPEG = ("mp3", "opus", "aac")
STREAM_FORMATS = ("audio", "sse")
MIN_SPEED, MAX_SPEED = 0.25, 4.0
CONTENT_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac"}
UNKNOWN_SIZE = 0xFFFFFFFF  # a streamed WAV's RIFF and data sizes: readers take the samples to the end
# The runner's refusals, by their code: the field each names.
_PARAM_OF_CODE = {"unknown_voice": "voice", "unsupported_speed": "speed"}


class SpeechRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: ModelId
    input: str
    voice: str = ""  # "": the model's default voice
    response_format: str = "wav"  # OpenAI's default is mp3, which exo cannot encode (see above)
    speed: float = 1.0
    stream_format: str = "audio"
    instructions: str = ""  # gpt-4o-mini-tts's; no model exo serves takes any
    keep_alive: str | int | float | None = None  # an extension, as Ollama's (exo/api/keep_alive.py)


def speech_inputs(body: SpeechRequest, max_chars: int) -> SpeakInputs:
    """The request checked: 400s naming the field."""
    if not body.input.strip():
        raise ApiError(400, "input must be the text to speak, not an empty string", param="input")
    if len(body.input) > max_chars:
        raise ApiError(400, f"input is {len(body.input)} characters long; at most {max_chars} "
                            "(EXO_MAX_SPEECH_CHARS)", param="input")
    if body.response_format in NEEDS_FFMPEG:
        raise ApiError(400, f"response_format {body.response_format!r} needs an encoder exo does not ship (ffmpeg): "
                            f"use one of {', '.join(RESPONSE_FORMATS)}", param="response_format")
    if body.response_format not in RESPONSE_FORMATS:
        raise ApiError(400, f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, not "
                            f"{body.response_format!r}", param="response_format")
    if not MIN_SPEED <= body.speed <= MAX_SPEED:
        raise ApiError(400, f"speed must be between {MIN_SPEED} and {MAX_SPEED}, not {body.speed:g}", param="speed")
    if body.stream_format not in STREAM_FORMATS:
        raise ApiError(400, f"stream_format must be 'audio' or 'sse', not {body.stream_format!r}",
                       param="stream_format")
    if body.instructions:
        raise ApiError(400, "instructions are not taken by the text-to-speech models exo serves", param="instructions")
    return SpeakInputs(text=body.input, voice=body.voice, speed=body.speed)


def check_speaks(ctx: ApiContext, model_id: ModelId) -> None:
    card = ctx.card(model_id)
    if card is not None and not card.speaks:  # None: generating() answers the 404
        raise ApiError(400, f"the model {model_id!r} does not turn text into speech (it is not a text-to-speech "
                            "model)", param="model")


async def speech(request: web.Request) -> web.StreamResponse:
    body = await decode_body(request, SpeechRequest)
    ctx = context_of(request)
    inputs = speech_inputs(body, ctx.settings.max_speech_chars)
    check_speaks(ctx, body.model)
    params = GenerationParams(speak=inputs)
    async with generating(ctx, body.model, params, keep_alive_s=keep_alive_seconds(body.keep_alive)) as generation:
        chunks = generation.chunks()
        first = await anext(chunks, None)  # the runner's acceptance (voice and speed checked): no audio yet
        if first is None:
            raise ApiError(502, "the speech ended before it began")
        _raise_if_failed(first, generation)
        if not first.sample_rate:
            raise ApiError(502, "the runner answered a speech request without a sample rate")
        writer = SpeechWriter(body.response_format, first.sample_rate)
        response = await _open(request, body, first.sample_rate)
        sse = SseStream(response) if body.stream_format == "sse" else None
        try:
            last = await _stream(writer, response, sse, _after(first, chunks))
        finally:
            ctx.metrics.count_audio(body.model, writer.samples / writer.sample_rate)
    return await _end(request, response, sse, last, generation)


async def _after(first: TokenChunk, chunks: AsyncIterator[TokenChunk]) -> AsyncIterator[TokenChunk]:
    yield first
    async for chunk in chunks:
        yield chunk


async def _open(request: web.Request, body: SpeechRequest, sample_rate: int) -> web.StreamResponse:
    headers = {"X-Sample-Rate": str(sample_rate), "Cache-Control": "no-cache"}
    if body.stream_format == "sse":
        headers |= {"Content-Type": "text/event-stream", "X-Accel-Buffering": "no"}
    else:
        headers |= {"Content-Type": CONTENT_TYPES[body.response_format],
                    "Content-Disposition": f"attachment; filename=speech.{body.response_format}"}
    response = web.StreamResponse(headers=headers)
    await response.prepare(request)
    return response


async def _stream(writer: SpeechWriter, response: web.StreamResponse, sse: SseStream | None,
                  chunks: AsyncIterator[TokenChunk]) -> TokenChunk | None:
    """Each chunk's audio out as it comes, in the asked format; the last chunk (None: none came)."""
    async for chunk in chunks:
        data = writer.encode(base64.b64decode(chunk.audio))
        if chunk.finish_reason is not None:
            data += writer.end()
        if data and sse is not None:
            await sse.send({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
        elif data:
            await response.write(data)
        if chunk.finish_reason is not None:
            return chunk
    return None


async def _end(request: web.Request, response: web.StreamResponse, sse: SseStream | None, last: TokenChunk | None,
               generation: Generation) -> web.StreamResponse:
    """A speech that ended well ends its stream; one that failed midway says so in an SSE stream's
    error event, and cuts an audio stream short (no end of the chunked body: clients see it broken)."""
    try:
        if last is None:
            raise ApiError(502, "the speech's stream ended without its last chunk")
        _raise_if_failed(last, generation)
    except ApiError as error:
        if sse is None:
            if request.transport is not None:
                request.transport.close()
            return response
        await sse.send({"type": "error", "error": {"message": error.message, "code": error.code}})
        return await sse.close()
    if sse is not None:
        usage = {"input_tokens": last.prompt_tokens, "output_tokens": last.token_count,
                 "total_tokens": last.prompt_tokens + last.token_count}
        await sse.send({"type": "speech.audio.done", "usage": usage})
    await response.write_eof()
    return response


def _raise_if_failed(chunk: TokenChunk, generation: Generation) -> None:
    """raise_if_failed, with the field a runner's refusal is about."""
    try:
        raise_if_failed(chunk, generation.failure)
    except ApiError as error:
        if error.code in _PARAM_OF_CODE:
            raise ApiError(error.status, error.message, param=_PARAM_OF_CODE[error.code], code=error.code) from None
        raise


class SpeechWriter:
    """16-bit mono PCM in, the response format's bytes out: a WAV's header before its first samples,
    FLAC's frames, or the samples as they are."""

    def __init__(self, response_format: str, sample_rate: int) -> None:
        self.response_format, self.sample_rate = response_format, sample_rate
        self.samples = 0
        self._flac = FlacEncoder(sample_rate) if response_format == "flac" else None
        self._started = False

    def encode(self, pcm: bytes) -> bytes:
        self.samples += len(pcm) // 2
        head = b"" if self._started else self._header()
        self._started = True
        return head + (self._flac.encode(pcm) if self._flac is not None else pcm)

    def end(self) -> bytes:
        return self._flac.end() if self._flac is not None else b""

    def _header(self) -> bytes:
        if self.response_format == "wav":
            return wav_header(self.sample_rate)
        return self._flac.header() if self._flac is not None else b""


def wav_header(sample_rate: int) -> bytes:
    """A canonical 44-byte header of 16-bit mono PCM, its sizes unknown (the stream's length is not yet)."""
    fmt = (16).to_bytes(4, "little") + (1).to_bytes(2, "little") + (1).to_bytes(2, "little") \
        + sample_rate.to_bytes(4, "little") + (2 * sample_rate).to_bytes(4, "little") \
        + (2).to_bytes(2, "little") + (16).to_bytes(2, "little")
    size = UNKNOWN_SIZE.to_bytes(4, "little")
    return b"RIFF" + size + b"WAVE" + b"fmt " + fmt + b"data" + size
