"""POST /v1/audio/transcriptions and /v1/audio/translations in OpenAI's shapes: a multipart form
(`file`, `model`, `language`, `prompt`, `response_format`, `temperature`,
`timestamp_granularities[]`) in; json, text, srt, verbose_json or vtt out, as whisper-1 answers.

The text is the runner's transcript with Whisper's leading space stripped, as OpenAI sends it;
subtitles are one cue per segment, timed as openai-whisper's writers time them.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from aiohttp import web

from exo.api.audio import AudioForm, Transcript, audio_seconds, read_form, run_transcription
from exo.api.context import context_of
from exo.api.errors import ApiError
from exo.core.ids import ModelId
from exo.core.requests import TranscribeInputs, TranscriptSegment

RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
GRANULARITIES = ("segment", "word")
_COMMON_FIELDS = {"model", "prompt", "response_format", "temperature"}
_TRANSCRIPTION_FIELDS = _COMMON_FIELDS | {"language", "timestamp_granularities[]", "timestamp_granularities", "stream"}
_LANGUAGE_CODE = re.compile(r"[a-z]{2,3}")  # ISO-639-1, and Whisper's "haw"


async def transcriptions(request: web.Request) -> web.StreamResponse:
    return await _answer(request, "transcribe")


async def translations(request: web.Request) -> web.StreamResponse:
    """Into English: no `language` (the model finds it), nor timestamps by word."""
    return await _answer(request, "translate")


async def _answer(request: web.Request, task: Literal["transcribe", "translate"]) -> web.StreamResponse:
    ctx = context_of(request)
    form = await read_form(request, ctx.settings.max_audio_bytes)
    allowed = _TRANSCRIPTION_FIELDS if task == "transcribe" else _COMMON_FIELDS
    if unknown := sorted(set(form.fields) - allowed):
        raise ApiError(400, f"unknown field {unknown[0]!r}; the fields are: file, {', '.join(sorted(allowed))}",
                       param=unknown[0])
    model = _one(form, "model")
    if not model:
        raise ApiError(400, "model is required: the id of a Whisper model", param="model")
    response_format = _one(form, "response_format") or "json"
    if response_format not in RESPONSE_FORMATS:
        raise ApiError(400, f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, not {response_format!r}",
                       param="response_format")
    granularities = _granularities(form, response_format)
    language = _one(form, "language") or ""
    if language and not _LANGUAGE_CODE.fullmatch(language):
        raise ApiError(400, f"language must be an ISO-639-1 code such as 'en', not {language!r}", param="language")
    # OpenAI ignores `stream` for whisper-1 (it answers whole): so does exo.
    seconds = audio_seconds(form.audio, ctx.settings.max_audio_seconds)
    assert form.audio is not None  # audio_seconds refused a form without one
    inputs = TranscribeInputs(audio="", seconds=seconds, task=task, language=language, prompt=_one(form, "prompt") or "",
                              temperature=_temperature(_one(form, "temperature")), word_timestamps="word" in granularities)
    done = await run_transcription(ctx, ModelId(model), form.audio, inputs)
    if response_format == "text":
        return web.Response(text=done.text.strip() + "\n", content_type="text/plain")
    if response_format in ("srt", "vtt"):
        return web.Response(text=subtitles(done.segments, response_format), content_type="text/plain")
    body = {"text": done.text.strip(), "usage": {"type": "duration", "seconds": math.ceil(done.seconds)}}
    if response_format == "verbose_json":
        body = _verbose(done, task, granularities) | body
    return web.json_response(body)


def _one(form: AudioForm, name: str) -> str | None:
    values = form.fields.get(name, [])
    if len(values) > 1:
        raise ApiError(400, f"{name} is given {len(values)} times; give it once", param=name)
    return values[0] if values else None


def _temperature(text: str | None) -> float:
    try:
        value = float(text) if text else 0.0
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise ApiError(400, f"temperature must be a number between 0 and 1, not {text!r}", param="temperature")
    return value


def _granularities(form: AudioForm, response_format: str) -> list[str]:
    given = form.fields.get("timestamp_granularities[]", []) + form.fields.get("timestamp_granularities", [])
    if bad := [g for g in given if g not in GRANULARITIES]:
        raise ApiError(400, f"timestamp_granularities[] may be 'segment' and 'word', not {bad[0]!r}",
                       param="timestamp_granularities[]")
    if given and response_format != "verbose_json":
        raise ApiError(400, "timestamp_granularities[] needs response_format verbose_json",
                       param="timestamp_granularities[]")
    return given or ["segment"]


def _verbose(done: Transcript, task: str, granularities: list[str]) -> dict[str, Any]:
    """OpenAI's verbose_json: a translation's language is its output's, always English."""
    body: dict[str, Any] = {"task": task, "language": "english" if task == "translate" else done.language,
                            "duration": round(done.seconds, 3)}
    if "segment" in granularities:
        body["segments"] = [{"id": s.id, "seek": s.seek, "start": s.start, "end": s.end, "text": s.text,
                             "tokens": s.tokens, "temperature": s.temperature, "avg_logprob": s.avg_logprob,
                             "compression_ratio": s.compression_ratio, "no_speech_prob": s.no_speech_prob}
                            for s in done.segments]
    if "word" in granularities:
        body["words"] = [{"word": w.word, "start": w.start, "end": w.end} for s in done.segments for w in s.words]
    return body


def subtitles(segments: list[TranscriptSegment], kind: str) -> str:
    """SubRip (numbered cues, "00:00:01,500") or WebVTT ("WEBVTT" header, "00:00:01.500"), one cue per segment."""
    marker = "," if kind == "srt" else "."
    cues = [f"{timestamp(s.start, marker)} --> {timestamp(s.end, marker)}\n{s.text.strip().replace('-->', '->')}\n"
            for s in segments]
    if kind == "srt":
        return "".join(f"{n}\n{cue}\n" for n, cue in enumerate(cues, start=1))
    return "WEBVTT\n\n" + "".join(f"{cue}\n" for cue in cues)


def timestamp(seconds: float, marker: str) -> str:
    """HH:MM:SS<marker>mmm, rounded to the millisecond."""
    milliseconds = round(seconds * 1000)
    hours, milliseconds = divmod(milliseconds, 3_600_000)
    minutes, milliseconds = divmod(milliseconds, 60_000)
    whole, milliseconds = divmod(milliseconds, 1000)
    return f"{hours:02d}:{minutes:02d}:{whole:02d}{marker}{milliseconds:03d}"
