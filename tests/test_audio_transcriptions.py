"""Speech to text: a tiny random Whisper made here (no Hub) transcribes a WAV made here exactly as
mlx-audio's own Whisper `generate` does on the same folder and file, in process and through the
cluster's /v1/audio/transcriptions and /v1/audio/translations in every response_format; bad
requests are 400s that name the field; a key's audio seconds are counted in /usage and /metrics."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from exo.api.errors import ApiError
from exo.core.requests import TranscribeInputs, TranscriptSegment
from tests.support.audio_node import audio_client, audio_node
from tests.support.polling import wait_until
from tests.support.tiny_model import TINY_MODEL_ID
from tests.support.whisper_model import WHISPER_MODEL_ID, make_tiny_whisper, tone_wav

MAX_AUDIO_BYTES, MAX_AUDIO_SECONDS = 200_000, 20  # the node's limits, small so the refusals are cheap to reach
FLOOR = -9999.0  # what a NaN or infinite measure is sent as


def test_subtitles_are_one_cue_per_segment_timed_to_the_millisecond():
    from exo.api.openai.audio import subtitles, timestamp

    segments = [TranscriptSegment(id=0, seek=0, start=0.0, end=1.5, text=" Hello there."),
                TranscriptSegment(id=1, seek=0, start=3725.5, end=3726.0004, text=" a --> b ")]
    assert subtitles(segments, "srt") == ("1\n00:00:00,000 --> 00:00:01,500\nHello there.\n\n"
                                          "2\n01:02:05,500 --> 01:02:06,000\na -> b\n\n")
    assert subtitles(segments, "vtt") == ("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello there.\n\n"
                                          "01:02:05.500 --> 01:02:06.000\na -> b\n\n")
    assert timestamp(59.9996, ",") == "00:01:00,000"


@pytest.mark.parametrize(("data", "why"), [
    (None, "file is required"),
    (b"OggS" + bytes(60), "file must be WAV, MP3 or FLAC audio"),
    (b"RIFF\x00\x00\x00\x00WAVEjunkjunk", "file is not readable WAV audio"),
    (tone_wav(0.0), "file holds no audio"),
    (tone_wav(2.5, rate=2000), "file is 2.5 seconds long, over the limit of 2 (EXO_MAX_AUDIO_SECONDS)"),
])
def test_the_audio_is_refused_by_its_header_before_anything_is_stored(data, why):
    from exo.api.audio import audio_seconds

    with pytest.raises(ApiError) as refused:
        audio_seconds(data, 2)
    assert (refused.value.status, refused.value.param) == (400, "file") and why in refused.value.message
    assert audio_seconds(tone_wav(1.5, rate=8000), 2) == 1.5


def test_measures_json_cannot_carry_become_the_floor():
    from exo.runner.transcription_engine import finite

    assert [finite(v) for v in (math.nan, -math.inf, math.inf, -0.25)] == [FLOOR, FLOOR, -FLOOR, -0.25]


@pytest.fixture(scope="module")
def whisper(tmp_path_factory) -> Path:
    return make_tiny_whisper(tmp_path_factory.mktemp("whisper") / "tiny-whisper")


@pytest.fixture(scope="module")
def wav(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("audio") / "tone.wav"
    path.write_bytes(tone_wav(3.0))
    return path


class Reference:
    """mlx-audio's Whisper on the same folder and file, with the seed exo's runner gives each request."""

    def __init__(self, folder: Path) -> None:
        from mlx_audio.stt.utils import load_model

        self.model = load_model(str(folder))
        # each (file, options) transcribed once: several tests ask for the same one (seconds each),
        # and with the seed set first mlx-audio gives the same answer every time
        self._done: dict[str, Any] = {}

    def __call__(self, wav: Path, **options: Any) -> Any:
        import mlx.core as mx

        from exo.runner.transcription_engine import FALLBACK_SEED

        key = json.dumps([str(wav), options], sort_keys=True)
        if key not in self._done:
            mx.random.seed(FALLBACK_SEED)
            self._done[key] = self.model.generate(str(wav), **options)
        return self._done[key]


@pytest.fixture(scope="module")
def reference(whisper) -> Reference:
    return Reference(whisper)


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"task": "translate"}, {"word_timestamps": True}, {"language": "en"},
                                     {"prompt": "bfaj asr"}])  # each gives this model other text than the first
def test_the_engine_transcribes_as_mlx_audio_does(whisper, wav, reference, options):
    from exo.runner.transcription_engine import TranscriptionEngine

    engine = TranscriptionEngine()
    engine.load(str(whisper))
    done = engine.transcribe(TranscribeInputs(audio="x", **options), str(wav))
    expected = reference(wav, **{"initial_prompt" if k == "prompt" else k: v for k, v in options.items()})
    assert done.text == expected.text and done.text.strip()
    assert [(s.start, s.end, s.text, s.tokens) for s in done.segments] == \
        [(s["start"], s["end"], s["text"], s["tokens"]) for s in expected.segments]
    assert [[(w.word, w.start, w.end) for w in s.words] for s in done.segments] == \
        [[(w["word"], w["start"], w["end"]) for w in s.get("words", [])] for s in expected.segments]
    assert done.tokens == sum(t < 50257 for s in expected.segments for t in s["tokens"]) > 0


@pytest.mark.slow
def test_a_cancel_stops_the_transcription_between_windows_and_leaves_the_engine_exact(whisper, tmp_path, wav,
                                                                                     reference):
    from exo.runner.transcription_engine import TranscriptionEngine

    engine = TranscriptionEngine()
    engine.load(str(whisper))
    long_audio = tmp_path / "long.wav"
    long_audio.write_bytes(tone_wav(75.0))  # three of Whisper's 30-second windows
    checks: list[int] = []

    def cancelled_after_the_first_window() -> bool:
        checks.append(1)
        return len(checks) > 1

    assert engine.transcribe(TranscribeInputs(audio="x"), str(long_audio), cancelled_after_the_first_window) is None
    assert len(checks) == 2  # the first window decoded, the second never started
    assert "decode" not in vars(engine.model)  # mlx-audio's own decode again
    done = engine.transcribe(TranscribeInputs(audio="x"), str(wav))
    assert done is not None and done.text == reference(wav).text


@pytest.fixture(scope="module")
def node(tmp_path_factory, whisper):
    env = {"EXO_MAX_AUDIO_BYTES": str(MAX_AUDIO_BYTES), "EXO_MAX_AUDIO_SECONDS": str(MAX_AUDIO_SECONDS)}
    with audio_node(tmp_path_factory, WHISPER_MODEL_ID, whisper, env) as exo:
        yield exo


@pytest.fixture(scope="module")
def http(node):
    with audio_client(node, WHISPER_MODEL_ID) as client:
        yield client


def _post(http: httpx.Client, wav: Path | bytes | None, route: str = "transcriptions", **fields: Any) -> httpx.Response:
    """A multipart form (also without a file), as OpenAI's client sends it."""
    parts = [(name, (None, value)) for name, values in {"model": WHISPER_MODEL_ID, **fields}.items()
             for value in (values if isinstance(values, list) else [values])]
    if wav is not None:
        parts.append(("file", ("speech.wav", wav.read_bytes() if isinstance(wav, Path) else wav)))
    return http.post(f"/v1/audio/{route}", files=parts)


def _segments(expected: Any) -> list[dict[str, Any]]:
    return [{"id": n, "seek": s["seek"], "start": s["start"], "end": s["end"], "text": s["text"], "tokens": s["tokens"],
             "temperature": s["temperature"], "avg_logprob": _floored(s["avg_logprob"]),
             "compression_ratio": _floored(s["compression_ratio"]), "no_speech_prob": _floored(s["no_speech_prob"])}
            for n, s in enumerate(expected.segments)]


def _floored(value: float) -> float:
    return FLOOR if math.isnan(value) else value


@pytest.mark.slow
def test_every_response_format_carries_the_reference_transcript(http, wav, reference):
    from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES

    expected = reference(wav)
    text = expected.text.strip()
    usage = {"type": "duration", "seconds": 3}
    assert _post(http, wav).json() == {"text": text, "usage": usage}
    plain = _post(http, wav, response_format="text")
    assert plain.headers["content-type"].startswith("text/plain") and plain.text == text + "\n"
    (segment,) = expected.segments  # three seconds: one segment
    assert segment["start"] == 0 and 0 < segment["end"] < 10
    seconds, milliseconds = divmod(round(segment["end"] * 1000), 1000)
    cue = f"00:00:0{seconds},{milliseconds:03d}\n{segment['text'].strip()}\n\n"
    assert _post(http, wav, response_format="srt").text == f"1\n00:00:00,000 --> {cue}"
    assert _post(http, wav, response_format="vtt").text == f"WEBVTT\n\n00:00:00.000 --> {cue.replace(',', '.', 1)}"
    verbose = _post(http, wav, response_format="verbose_json").json()
    language = LANGUAGES[expected.language]
    assert verbose == {"task": "transcribe", "language": language, "duration": 3.0, "text": text,
                       "segments": _segments(expected), "usage": usage}


@pytest.mark.slow
def test_word_timestamps_translations_and_the_openai_client(http, node, wav, reference):
    words = reference(wav, word_timestamps=True)
    answer = _post(http, wav, response_format="verbose_json", **{"timestamp_granularities[]": ["word", "segment"]}).json()
    assert answer["words"] == [{"word": w["word"], "start": w["start"], "end": w["end"]}
                               for s in words.segments for w in s["words"]] and answer["words"]
    assert answer["segments"] == _segments(words)
    translated = reference(wav, task="translate")
    body = _post(http, wav, "translations", response_format="verbose_json").json()
    assert (body["task"], body["language"], body["text"]) == ("translate", "english", translated.text.strip())
    assert body["segments"] == _segments(translated)
    client = openai.OpenAI(base_url=f"{node.url}/v1", api_key="none")
    with wav.open("rb") as file:
        assert client.audio.transcriptions.create(model=WHISPER_MODEL_ID, file=file).text == reference(wav).text.strip()


@pytest.mark.slow
@pytest.mark.parametrize(("wav", "fields", "param", "message"), [
    (None, {}, "file", "file is required"),
    (tone_wav(7.0), {}, "file", f"file is larger than the limit of {MAX_AUDIO_BYTES} bytes (EXO_MAX_AUDIO_BYTES)"),
    (tone_wav(25.0, rate=2000), {}, "file", "file is 25.0 seconds long, over the limit of 20 (EXO_MAX_AUDIO_SECONDS)"),
    (b"OggS" + bytes(100), {}, "file", "file must be WAV, MP3 or FLAC audio"),
    (tone_wav(1.0), {"response_format": "mp4"}, "response_format", "response_format must be one of json, text, srt"),
    (tone_wav(1.0), {"temperature": "2"}, "temperature", "temperature must be a number between 0 and 1"),
    (tone_wav(1.0), {"timestamp_granularities[]": "word"}, "timestamp_granularities[]", "needs response_format verbose_json"),
    (tone_wav(1.0), {"language": "English"}, "language", "language must be an ISO-639-1 code"),
    (tone_wav(1.0), {"speed": "1"}, "speed", "unknown field 'speed'"),
    (tone_wav(1.0), {"model": TINY_MODEL_ID}, "model", "does not turn speech into text"),
])
def test_bad_requests_are_400s_that_name_the_field(http, wav, fields, param, message):
    answer = _post(http, wav, **fields)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and message in error["message"], error


@pytest.mark.slow
def test_other_routes_refuse_what_they_do_not_serve(http, wav):
    translated = _post(http, wav, "translations", language="de")
    assert translated.status_code == 400 and translated.json()["error"]["param"] == "language"
    unknown = _post(http, tone_wav(1.0), language="xx")
    assert unknown.status_code == 400 and "language 'xx' is not one Whisper knows" in unknown.text
    chat = http.post("/v1/chat/completions", json={"model": WHISPER_MODEL_ID, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "is a speech-to-text model" in chat.text
    placed = http.post("/place_instance", json={"model_id": WHISPER_MODEL_ID, "min_nodes": 2})
    assert placed.status_code == 409 and "a speech-to-text model runs on one node" in placed.text
    assert http.get(f"/v1/models/{WHISPER_MODEL_ID}").json()["card"]["transcribes"] is True
    form = http.post("/v1/audio/transcriptions", json={"model": WHISPER_MODEL_ID})
    assert form.status_code == 400 and "multipart/form-data" in form.text


def _audio_seconds_counted(metrics: str) -> float:
    found = re.search(rf'^exo_audio_seconds_total{{model="{re.escape(WHISPER_MODEL_ID)}"}} (\S+)$', metrics, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.mark.slow
def test_a_keys_transcription_counts_its_audio_seconds_in_usage_and_metrics(http, node, wav):
    """Last in the module: while the key exists, every request to the node needs one."""
    before = _audio_seconds_counted(http.get("/metrics").text)
    added = http.post("/keys", json={"name": "listener", "admin": True})  # admin: it reads /metrics, deletes itself
    assert added.status_code == 200, added.text
    key_id, secret = added.json()["key"]["key_id"], added.json()["secret"]
    with httpx.Client(base_url=node.url, timeout=300, headers={"Authorization": f"Bearer {secret}"}) as keyed:
        try:
            assert _post(keyed, wav).json()["usage"] == {"type": "duration", "seconds": 3}
            assert _audio_seconds_counted(keyed.get("/metrics").text) == before + 3.0
            rows = wait_until(lambda: [r for r in keyed.get(f"/usage?key_id={key_id}").json()["data"]
                                       if r["audio_seconds"]], 10, what="the audio in the key's usage")
        finally:
            deleted = keyed.delete(f"/keys/{key_id}")
    assert deleted.status_code == 200, deleted.text
    assert [(r["model"], r["requests"], r["audio_seconds"]) for r in rows] == [(WHISPER_MODEL_ID, 1, 3.0)]
