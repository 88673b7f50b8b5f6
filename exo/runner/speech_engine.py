"""A text-to-speech model on one node: a model of one of mlx-audio's TTS families (Soprano, Kokoro,
...) as shipped, behind the runner's engine interface.

mlx-audio's loader and the model's own `generate` make the speech. The model yields it a segment at
a time (Soprano: each line of the text; Kokoro: each of its splits), and each segment goes out as it
comes, in chunks of at most CHUNK_SAMPLES samples of 16-bit PCM made as mlx-audio's server makes
its WAV and PCM answers (clipped to [-1, 1], times 32767, truncated). Every request's sampling is
seeded alike, so the same text gets the same audio.

Voices: a model that ships voice packs (`voices/<name>.safetensors`, Kokoro's layout, which
mlx-audio's server lists as the model's voices) speaks in those; a model without has one voice,
answering to "default" and to OpenAI's voice names, so OpenAI's clients (which always send one) work
unchanged. `speed` reaches a model whose `generate` takes one; another speaks at its own pace only.
"""

from __future__ import annotations

import base64
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from exo.core.catalogue import is_text_to_speech_config
from exo.core.ids import TaskId
from exo.core.requests import GenerationParams, SpeakInputs, TokenChunk
from exo.core.types import SamplingDefaults
from exo.runner.decoding import GenerationResult, OnOutput, RequestRefused
from exo.runner.engine import Engine
from exo.runner.protocol import RankSetup
from exo.settings.services import RunnerSettings

SPEECH_SEED = 0
CHUNK_SAMPLES = 16_384  # 32 KiB of PCM, 44 KB as base64: far below a NATS message
DEFAULT_VOICE = "default"
OPENAI_VOICES = ("alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage",
                 "shimmer", "verse")


class UnknownVoice(RequestRefused):
    code = "unknown_voice"


class UnsupportedSpeed(RequestRefused):
    code = "unsupported_speed"


class Spoken(NamedTuple):
    seconds: float  # of speech generated and handed on
    tokens: int  # the model's generated tokens, as its results count them (0 where it does not say)
    cancelled: bool
    input_tokens: int = 0  # the text's, by the model's tokenizer (0: it has none exo can call)


def is_text_to_speech_model(model_path: str) -> bool:
    try:
        return is_text_to_speech_config(json.loads((Path(model_path) / "config.json").read_text()))
    except (OSError, ValueError):
        return False


def pcm16(audio: Any) -> bytes:
    """16-bit little-endian PCM, as mlx_audio.audio_io.write makes it from its server's float32 audio."""
    samples = np.asarray(audio)
    if samples.dtype in (np.float32, np.float64):
        samples = (np.clip(samples, -1.0, 1.0) * 32767).astype(np.int16)
    return samples.astype("<i2").tobytes()


class SpeechEngine(Engine):
    def __init__(self, settings: RunnerSettings = RunnerSettings()) -> None:
        super().__init__(settings)
        self.batches = False
        self.sample_rate = 0
        self.voices: list[str] = []  # its voice packs' names; none: one voice
        self.takes_speed = False

    def load(self, model_path: str, shard: RankSetup | None = None, max_context: int = 0, kv_bits: int = 0,
             adapter_path: str = "") -> None:
        if adapter_path:
            raise ValueError("LoRA adapters are served on text models, not text-to-speech models")
        if shard is not None:
            raise ValueError("a text-to-speech model runs on one node: place it with min_nodes 1")
        if kv_bits:
            raise ValueError("a quantized KV cache is not served for text-to-speech models")
        from mlx_audio.tts.utils import load_model  # imports mlx-audio's TTS registry: only where it serves

        self.model = load_model(Path(model_path))
        self.sample_rate = int(self.model.sample_rate)
        self.voices = sorted(path.stem for path in (Path(model_path) / "voices").glob("*.safetensors"))
        self.takes_speed = "speed" in inspect.signature(self.model.generate).parameters

    def warm_up(self) -> None:
        for _ in self.model.generate("Warm up.", **self._voice_and_speed(SpeakInputs(text=""))):
            pass

    def generate(self, params: GenerationParams, defaults: SamplingDefaults, on_output: OnOutput, *args: Any,
                 **kwargs: Any) -> GenerationResult:
        raise RequestRefused("this model turns text into speech and does not generate text: use POST /v1/audio/speech")

    def speak(self, inputs: SpeakInputs, on_audio: Callable[[bytes, int], None],
              is_cancelled: Callable[[], bool]) -> Spoken:
        """On the model thread: `on_audio(b"", rate)` once the request is accepted, then each piece of
        PCM as the model makes it; stops after the segment in which the task was cancelled."""
        options = self._voice_and_speed(inputs)
        on_audio(b"", self.sample_rate)
        samples = tokens = 0
        encode = getattr(getattr(self.model, "tokenizer", None), "encode", None)
        input_tokens = len(encode(inputs.text)) if callable(encode) else 0
        mx.random.seed(SPEECH_SEED)
        for result in self.model.generate(inputs.text, **options):
            if int(result.sample_rate) != self.sample_rate:
                raise RuntimeError(f"the model said its audio is at {self.sample_rate} Hz, then made {result.sample_rate} Hz")
            pcm = pcm16(result.audio)
            for start in range(0, len(pcm), 2 * CHUNK_SAMPLES):
                on_audio(pcm[start:start + 2 * CHUNK_SAMPLES], self.sample_rate)
            samples, tokens = samples + len(pcm) // 2, tokens + int(getattr(result, "token_count", 0) or 0)
            self.beat()
            if is_cancelled():
                return Spoken(samples / self.sample_rate, tokens, True, input_tokens)
        return Spoken(samples / self.sample_rate, tokens, False, input_tokens)

    def _voice_and_speed(self, inputs: SpeakInputs) -> dict[str, Any]:
        """The voice and speed as the model's `generate` takes them; UnknownVoice / UnsupportedSpeed if it cannot."""
        options: dict[str, Any] = {"voice": self._voice(inputs.voice)}
        if self.takes_speed:
            options["speed"] = inputs.speed
        elif inputs.speed != 1.0:
            raise UnsupportedSpeed(f"speed {inputs.speed:g} is not one this model can do: it speaks at its own pace "
                                   "(speed 1)")
        return options

    def _voice(self, asked: str) -> str | None:
        if self.voices:
            if asked in self.voices:
                return asked
            if not asked or asked == DEFAULT_VOICE:
                return None  # the model's own default
            raise UnknownVoice(f"voice {asked!r} is not one of this model's voices: {', '.join(self.voices)}")
        if not asked or asked == DEFAULT_VOICE or asked in OPENAI_VOICES:
            return None
        raise UnknownVoice(f"voice {asked!r} is not one this model answers to: it has one voice, called "
                           f"{DEFAULT_VOICE!r} or by any of OpenAI's voice names ({', '.join(OPENAI_VOICES)})")


class SpeechChunks:
    """A speech task's chunks, numbered as the model thread hands them on; every one carries the rate."""

    def __init__(self, task_id: TaskId, send: Callable[[TokenChunk], object]) -> None:
        self.task_id, self.send = task_id, send
        self.index = 0

    def add(self, pcm: bytes, sample_rate: int) -> None:
        self.send(TokenChunk(command_id=self.task_id, index=self.index, sample_rate=sample_rate,
                             audio=base64.b64encode(pcm).decode()))
        self.index += 1


def speak(engine: object, inputs: SpeakInputs | None, chunks: SpeechChunks, is_cancelled: Callable[[], bool]) -> Spoken:
    """A speech task on the model thread, whatever model the runner serves (another is refused)."""
    if not isinstance(engine, SpeechEngine) or inputs is None:
        raise RequestRefused("this model does not turn text into speech")
    return engine.speak(inputs, chunks.add, is_cancelled)
