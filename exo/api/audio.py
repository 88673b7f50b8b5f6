"""Speech to text, what the audio routes share: the multipart form read within its bounds, the
audio checked (a format the runner reads, its length), stored in the object store exo-images by
its sha256 as chat images are (workers fetch it before the task runs), and the transcription run
through the cluster as a task: the runner answers one chunk per segment, then the whole text.

Formats: WAV, MP3 and FLAC, read by miniaudio here (length) and by mlx-audio on the runner; others
(Ogg, M4A, WebM) need ffmpeg, which exo does not ship, and are refused before anything is stored.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import msgspec
from aiohttp import BodyPartReader, web

from exo.api.collect import raise_if_failed
from exo.api.context import ApiContext
from exo.api.errors import ApiError
from exo.api.generation import generating
from exo.bus.images import ImageStoreFull, delete_image, image_digest, store_image
from exo.core.ids import ModelId
from exo.core.requests import GenerationParams, TokenChunk, TranscribeInputs, TranscriptSegment

MAX_FIELD_BYTES = 64 * 1024  # a form field besides the file: a prompt is a few hundred words
FORMATS = "WAV, MP3 or FLAC"
_INFO = {"wav": "wav_get_info", "mp3": "mp3_get_info", "flac": "flac_get_info"}  # miniaudio's readers by format


@dataclass
class AudioForm:
    """A multipart form: its text fields (a name may repeat, as `timestamp_granularities[]`) and its file."""

    fields: dict[str, list[str]] = field(default_factory=dict)
    audio: bytes | None = None


@dataclass(frozen=True)
class Transcript:
    text: str
    language: str  # by name, as the runner said it
    segments: list[TranscriptSegment]
    seconds: float  # the audio's length


async def read_form(request: web.Request, max_audio_bytes: int) -> AudioForm:
    if request.content_type != "multipart/form-data":
        raise ApiError(400, "send the audio as multipart/form-data, with the fields `file` and `model` (OpenAI's shape)")
    form = AudioForm()
    try:
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader) or not part.name:
                raise ApiError(400, "every part of the form must be a named field (no nested multipart)")
            if part.name == "file":
                form.audio = await _bounded(part, max_audio_bytes, f"file is larger than the limit of {max_audio_bytes} "
                                            "bytes (EXO_MAX_AUDIO_BYTES)")
            else:
                text = await _bounded(part, MAX_FIELD_BYTES, f"{part.name} is longer than {MAX_FIELD_BYTES} bytes")
                form.fields.setdefault(part.name, []).append(text.decode("utf-8", errors="replace"))
    except (ValueError, AssertionError) as error:  # aiohttp's ways of saying the body is not a form
        raise ApiError(400, f"the body is not a valid multipart form: {error}") from None
    return form


async def _bounded(part: BodyPartReader, limit: int, too_big: str) -> bytes:
    data = bytearray()
    while chunk := await part.read_chunk(1 << 16):
        data += chunk
        if len(data) > limit:
            raise ApiError(400, too_big, param=part.name)
    return bytes(data)


def audio_seconds(data: bytes | None, max_seconds: float) -> float:
    """The file's length, read from its header: a 400 naming `file` for no file, an empty one, one
    that is no audio the runner reads, or one longer than `max_seconds`."""
    if data is None:
        raise ApiError(400, "file is required: the audio to transcribe, as a form field", param="file")
    kind = _format_of(data)
    if kind is None:
        raise ApiError(400, f"file must be {FORMATS} audio (other formats need ffmpeg, which exo does not ship)",
                       param="file")
    import miniaudio  # here: it imports numpy, a third of a node's start-up, for a route most never use

    read_info: Callable[[bytes], miniaudio.SoundFileInfo] = getattr(miniaudio, _INFO[kind])
    try:
        info = read_info(data)
    except miniaudio.DecodeError as error:
        raise ApiError(400, f"file is not readable {kind.upper()} audio: {error}", param="file") from None
    seconds = info.num_frames / info.sample_rate if info.sample_rate else 0.0
    if seconds <= 0:
        raise ApiError(400, "file holds no audio (no samples)", param="file")
    if seconds > max_seconds:
        raise ApiError(400, f"file is {seconds:.1f} seconds long, over the limit of {max_seconds:g} "
                            "(EXO_MAX_AUDIO_SECONDS)", param="file")
    return seconds


def _format_of(data: bytes) -> str | None:
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:4] == b"fLaC":
        return "flac"
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE6 in (0xE2, 0xE4, 0xE6)):
        return "mp3"  # an ID3 tag, or an MPEG audio frame's sync bits with layer I, II or III
    return None


def check_transcribes(ctx: ApiContext, model_id: ModelId) -> None:
    card = ctx.card(model_id)
    if card is not None and not card.transcribes:  # None: generating() answers the 404
        raise ApiError(400, f"the model {model_id!r} does not turn speech into text (it is not a Whisper model)",
                       param="model")


async def run_transcription(ctx: ApiContext, model_id: ModelId, audio: bytes, inputs: TranscribeInputs) -> Transcript:
    """`inputs` without its digest: the audio's is set here."""
    check_transcribes(ctx, model_id)
    inputs = msgspec.structs.replace(inputs, audio=image_digest(audio))
    chunks: dict[int, TokenChunk] = {}
    async with generating(ctx, model_id, GenerationParams(transcribe=inputs), storing=_stored(ctx, audio)) as generation:
        async for chunk in generation.chunks():
            raise_if_failed(chunk, generation.failure)
            chunks[chunk.index] = chunk
    ordered = [chunks[n] for n in sorted(chunks)]
    segments = [chunk.segment for chunk in ordered[:-2] if chunk.segment is not None]
    if sorted(chunks) != list(range(len(segments) + 2)):
        raise ApiError(502, f"the runner answered {len(chunks)} chunks, not one per segment, the text and the end")
    ctx.metrics.count_audio(model_id, inputs.seconds)
    return Transcript(ordered[-2].text, ordered[-2].language, segments, inputs.seconds)


@asynccontextmanager
async def _stored(ctx: ApiContext, audio: bytes) -> AsyncIterator[None]:
    """The audio in the object store for the block, which queues the task; removed again if the
    block raises (the master refused it) and no open task uses it."""
    try:
        digest, new = await store_image(ctx.nc, audio, image_digest(audio))
    except ImageStoreFull as full:
        raise ApiError(507, str(full), code="insufficient_storage") from None
    try:
        yield
    except BaseException:
        in_use = {t.params.transcribe.audio for t in ctx.view.state.tasks.values()
                  if t.status in ("pending", "running") and t.params.transcribe is not None}
        if new and digest not in in_use:
            await delete_image(ctx.nc, digest)
        raise

