"""A speech-to-text model (Whisper) on one node: mlx-audio's Whisper as shipped, behind the runner's
engine interface.

mlx-audio's loader (transformers' or mlx-audio's own checkpoint layout) and its `generate` (its
port of openai-whisper's transcribe: 30-second windows, temperature fallback, segment and word
timestamps) turn the file into text; the file is read by mlx-audio's own reader (miniaudio: WAV,
MP3 and FLAC; no ffmpeg is installed), so the transcript is the library's for the same file.
mlx-audio rather than mlx-whisper: it is installed already (mlx-vlm needs it) and needs no torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from exo.core.catalogue import is_speech_to_text_config
from exo.core.ids import TaskId
from exo.core.requests import GenerationParams, TokenChunk, TranscribeInputs, TranscriptSegment, TranscriptWord
from exo.core.types import SamplingDefaults
from exo.runner.decoding import GenerationResult, OnOutput, RequestRefused
from exo.runner.engine import LOGPROB_FLOOR, Engine
from exo.runner.protocol import RankSetup
from exo.settings.services import RunnerSettings

SAMPLE_RATE = 16_000  # what Whisper hears: mlx-audio's reader resamples every file to it
# The temperature fallback samples: one seed per request, so the same audio gets the same transcript.
FALLBACK_SEED = 0


class Transcribed(NamedTuple):
    text: str  # the whole transcript, as mlx-audio decodes it (with Whisper's leading space)
    language: str  # the language spoken, by name ("english"), as OpenAI's verbose_json says it
    segments: list[TranscriptSegment]
    tokens: int  # the text tokens decoded: the task's completion tokens


def is_speech_to_text_model(model_path: str) -> bool:
    try:
        return is_speech_to_text_config(json.loads((Path(model_path) / "config.json").read_text()))
    except (OSError, ValueError):
        return False


class TranscriptionEngine(Engine):
    def __init__(self, settings: RunnerSettings = RunnerSettings()) -> None:
        super().__init__(settings)
        self.batches = False

    def load(self, model_path: str, shard: RankSetup | None = None, max_context: int = 0, kv_bits: int = 0,
             adapter_path: str = "") -> None:
        if adapter_path:
            raise ValueError("LoRA adapters are served on text models, not speech-to-text models")
        if shard is not None:
            raise ValueError("a speech-to-text model runs on one node: place it with min_nodes 1")
        if kv_bits:
            raise ValueError("a quantized KV cache is not served for speech-to-text models")
        from mlx_audio.stt.utils import load_model  # imports mlx-audio's model registry: only where it serves

        self.model = load_model(model_path)
        if getattr(self.model, "_processor", None) is None:  # mlx-audio only warns: its tokenizer comes with it
            raise ValueError(f"{model_path} has no Whisper tokenizer and feature extractor files exo can read")

    def warm_up(self) -> None:
        self.model.generate(np.zeros(SAMPLE_RATE, dtype=np.float32), language="en", temperature=0.0)

    def generate(self, params: GenerationParams, defaults: SamplingDefaults, on_output: OnOutput, *args: Any,
                 **kwargs: Any) -> GenerationResult:
        raise RequestRefused("this model turns speech into text and does not generate text: use "
                             "POST /v1/audio/transcriptions")

    def transcribe(self, inputs: TranscribeInputs, audio_path: str,
                   is_cancelled: Callable[[], bool] = lambda: False) -> Transcribed | None:
        """The transcript, or None when the task was cancelled: checked before each 30-second window."""
        from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES
        from mlx_audio.stt.utils import load_audio

        if inputs.language and inputs.language not in LANGUAGES:
            raise RequestRefused(f"language {inputs.language!r} is not one Whisper knows: give an ISO-639-1 code "
                                 f"({', '.join(list(LANGUAGES)[:5])}, ...) or none to detect it")
        try:
            audio = load_audio(audio_path)
        except Exception as error:  # noqa: BLE001 - whatever the reader says, the file is the client's
            raise RequestRefused(f"the file is not audio this model can read (WAV, MP3 or FLAC): {error}") from None
        mx.random.seed(FALLBACK_SEED)
        try:
            with _windows_checked(self.model, is_cancelled, self.beat):
                result = self.model.generate(audio, task=inputs.task, language=inputs.language or None,
                                             initial_prompt=inputs.prompt or None,
                                             word_timestamps=inputs.word_timestamps,
                                             **({"temperature": inputs.temperature} if inputs.temperature else {}))
        except _Cancelled:
            return None
        self.beat()
        segments = [_segment(n, raw) for n, raw in enumerate(result.segments or [])]
        tokens = sum(1 for segment in segments for token in segment.tokens if token < self._end_of_text())
        return Transcribed(result.text, LANGUAGES.get(result.language, result.language or ""), segments, tokens)

    def _end_of_text(self) -> int:
        end: int = self.model.get_tokenizer().eot
        return end


class _Cancelled(Exception):
    """Raised between Whisper's windows to leave mlx-audio's generate when the task is cancelled."""


@contextmanager
def _windows_checked(model: Any, is_cancelled: Callable[[], bool], beat: Callable[[], None]) -> Iterator[None]:
    """mlx-audio's generate has no per-step hook, but it calls the model's `decode` once per 30-second
    window (and per temperature fallback): shadow it on the instance for this call, to stop between
    windows and to beat there (a long file is many windows)."""
    decode = model.decode

    def decode_unless_cancelled(*args: Any, **kwargs: Any) -> Any:
        if is_cancelled():
            raise _Cancelled
        beat()
        return decode(*args, **kwargs)

    model.decode = decode_unless_cancelled
    try:
        yield
    finally:
        del model.decode  # the class's method again


def _segment(index: int, raw: dict[str, Any]) -> TranscriptSegment:
    words = [TranscriptWord(word=w["word"], start=float(w["start"]), end=float(w["end"])) for w in raw.get("words", [])]
    return TranscriptSegment(id=index, seek=int(raw["seek"]), start=float(raw["start"]), end=float(raw["end"]),
                             text=raw["text"], tokens=[int(t) for t in raw["tokens"]],
                             temperature=float(raw["temperature"]), avg_logprob=finite(raw["avg_logprob"]),
                             compression_ratio=finite(raw["compression_ratio"]),
                             no_speech_prob=finite(raw["no_speech_prob"]), words=words)


def finite(value: float) -> float:
    """A measure as JSON can carry it: a decoding with no text tokens averages to NaN, one whose
    tokens had no chance to -inf; both are the floor OpenAI sends for "no chance" (exo/runner/engine.py)."""
    return LOGPROB_FLOOR if math.isnan(value) else max(LOGPROB_FLOOR, min(float(value), -LOGPROB_FLOOR))


def transcript_chunks(task_id: TaskId, done: Transcribed) -> list[TokenChunk]:
    """What a transcription publishes before its final chunk: one chunk per segment (index = the
    segment's), then one with the whole text and the language."""
    chunks = [TokenChunk(command_id=task_id, index=n, segment=segment) for n, segment in enumerate(done.segments)]
    return chunks + [TokenChunk(command_id=task_id, index=len(chunks), text=done.text, language=done.language)]
