"""Text to speech: a tiny random Soprano made here (no Hub) speaks exactly as mlx-audio's own model
`generate` does on the same folder, text and seed, its samples written as mlx-audio's server writes
them (mlx_audio.audio_io.write): in process, and through the cluster's /v1/audio/speech as WAV, PCM,
FLAC (read back by miniaudio's decoder, which checks every frame's CRCs) and OpenAI's SSE events,
streamed a segment at a time. Bad requests are 400s naming the field; a key's speech is counted in
seconds in /usage and /metrics; Open WebUI's request shape is answered."""

from __future__ import annotations

import base64
import io
import json
import re
import time
import wave
from pathlib import Path
from typing import Any

import httpx
import miniaudio
import numpy as np
import openai
import pytest

from exo.api.errors import ApiError
from exo.core.requests import SpeakInputs
from tests.support.audio_node import audio_client, audio_node
from tests.support.polling import wait_until
from tests.support.soprano_model import SPEECH_MODEL_ID, make_tiny_soprano
from tests.support.tiny_model import TINY_MODEL_ID

RATE = 32_000  # Soprano's
MAX_CHARS = 300  # the node's EXO_MAX_SPEECH_CHARS, small so the refusal is cheap to reach
SHORT = "Hello world."
LONG = "The first line is here.\nThen a second line follows it.\nAnd a third one ends the text."  # three segments
LONGER = "\n".join(f"This is line {n} of a longer text." for n in range(1, 6))  # five segments


def _decoded(data: bytes) -> np.ndarray:
    decoded = miniaudio.decode(data, output_format=miniaudio.SampleFormat.SIGNED16, nchannels=1, sample_rate=RATE)
    assert decoded.sample_rate == RATE
    return np.array(decoded.samples, dtype=np.int16)


def test_flac_frames_decode_to_the_samples_they_were_made_from():
    from exo.api.flac import BLOCK_SAMPLES, FlacEncoder

    samples = (np.random.default_rng(3).standard_normal(3 * BLOCK_SAMPLES + 123) * 4000).astype("<i2")
    encoder = FlacEncoder(RATE)
    data = encoder.header() + b"".join(encoder.encode(samples[n:n + 5000].tobytes())
                                       for n in range(0, len(samples), 5000)) + encoder.end()
    assert np.array_equal(_decoded(data), samples)
    assert miniaudio.flac_get_info(data).sample_rate == RATE


def test_a_streamed_wav_header_reads_as_16_bit_mono_to_the_end():
    from exo.api.openai.speech import wav_header

    samples = np.arange(-500, 500, dtype="<i2")
    with wave.open(io.BytesIO(wav_header(24_000) + samples.tobytes())) as file:
        assert (file.getnchannels(), file.getsampwidth(), file.getframerate()) == (1, 2, 24_000)
        assert np.array_equal(np.frombuffer(file.readframes(10**6), "<i2"), samples)


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"input": " \n"}, "input", "input must be the text to speak"),
    ({"input": "x" * 11}, "input", "input is 11 characters long; at most 10 (EXO_MAX_SPEECH_CHARS)"),
    ({"response_format": "mp3"}, "response_format", "needs an encoder exo does not ship (ffmpeg)"),
    ({"response_format": "ogg"}, "response_format", "response_format must be one of wav, pcm, flac"),
    ({"speed": 0.2}, "speed", "speed must be between 0.25 and 4.0"),
    ({"speed": 4.5}, "speed", "speed must be between 0.25 and 4.0"),
    ({"stream_format": "chunks"}, "stream_format", "stream_format must be 'audio' or 'sse'"),
    ({"instructions": "Speak softly."}, "instructions", "instructions are not taken"),
])
def test_a_request_is_checked_field_by_field(fields, param, message):
    from exo.api.openai.speech import SpeechRequest, speech_inputs

    with pytest.raises(ApiError) as refused:
        speech_inputs(SpeechRequest(**{"model": "m", "input": "hi", **fields}), max_chars=10)
    assert (refused.value.status, refused.value.param) == (400, param) and message in refused.value.message
    assert speech_inputs(SpeechRequest(model="m", input="x" * 10, speed=0.25), 10) == SpeakInputs(text="x" * 10,
                                                                                                   speed=0.25)


@pytest.fixture(scope="module")
def soprano(tmp_path_factory) -> Path:
    return make_tiny_soprano(tmp_path_factory.mktemp("soprano") / "tiny-soprano")


class Reference:
    """mlx-audio's Soprano on the same folder, seeded as exo's runner seeds each request, its audio
    written as mlx-audio's server writes its answers."""

    def __init__(self, folder: Path) -> None:
        from mlx_audio.tts.utils import load_model

        self.model = load_model(folder)
        self._spoken: dict[str, list[np.ndarray]] = {}

    def segments(self, text: str) -> list[np.ndarray]:
        import mlx.core as mx

        from exo.runner.speech_engine import SPEECH_SEED

        if text not in self._spoken:
            mx.random.seed(SPEECH_SEED)
            self._spoken[text] = [np.array(result.audio) for result in self.model.generate(text)]
        return self._spoken[text]

    def written(self, text: str, response_format: str) -> bytes:
        from mlx_audio.audio_io import write

        out = io.BytesIO()
        write(out, np.concatenate(self.segments(text)), RATE, format=response_format)
        return out.getvalue()

    def samples(self, text: str) -> np.ndarray:
        return np.frombuffer(self.written(text, "pcm"), "<i2")


@pytest.fixture(scope="module")
def reference(soprano) -> Reference:
    return Reference(soprano)


@pytest.mark.slow
def test_the_engine_speaks_as_mlx_audio_does(soprano, reference):
    from exo.runner.speech_engine import SpeechEngine, UnknownVoice, UnsupportedSpeed

    engine = SpeechEngine()
    engine.load(str(soprano))
    pieces: list[bytes] = []
    spoken = engine.speak(SpeakInputs(text=LONG, voice="alloy"), lambda pcm, rate: pieces.append(pcm), lambda: False)
    assert pieces[0] == b"" and b"".join(pieces) == reference.written(LONG, "pcm")
    assert len(reference.segments(LONG)) == 3 and len(pieces) >= 4  # the acceptance, then a piece per segment at least
    assert spoken.seconds == len(reference.samples(LONG)) / RATE and not spoken.cancelled
    with pytest.raises(UnknownVoice, match="voice 'nobody' is not one this model answers to"):
        engine.speak(SpeakInputs(text=SHORT, voice="nobody"), lambda pcm, rate: None, lambda: False)
    with pytest.raises(UnsupportedSpeed, match="speed 2 is not one this model can do"):
        engine.speak(SpeakInputs(text=SHORT, speed=2.0), lambda pcm, rate: None, lambda: False)
    cut = engine.speak(SpeakInputs(text=LONG), lambda pcm, rate: None, lambda: True)  # stops after a segment
    assert cut.cancelled and cut.seconds == len(reference.segments(LONG)[0]) / RATE


@pytest.fixture(scope="module")
def node(tmp_path_factory, soprano):
    env = {"EXO_MAX_SPEECH_CHARS": str(MAX_CHARS)}
    with audio_node(tmp_path_factory, SPEECH_MODEL_ID, soprano, env) as exo:
        yield exo


@pytest.fixture(scope="module")
def http(node):
    with audio_client(node, SPEECH_MODEL_ID) as client:
        yield client


def _speak(http: httpx.Client, text: str = SHORT, **fields: Any) -> httpx.Response:
    return http.post("/v1/audio/speech", json={"model": SPEECH_MODEL_ID, "input": text, "voice": "alloy", **fields})


@pytest.mark.slow
def test_wav_pcm_and_flac_carry_the_reference_samples(http, reference):
    wav = _speak(http, LONG, response_format="wav")
    assert wav.status_code == 200, wav.text
    assert (wav.headers["content-type"], wav.headers["x-sample-rate"]) == ("audio/wav", str(RATE))
    written = reference.written(LONG, "wav")  # miniaudio's header, which knows the length; exo's streams
    with wave.open(io.BytesIO(written)) as theirs, wave.open(io.BytesIO(wav.content)) as ours:
        assert ours.getparams()[:3] == theirs.getparams()[:3] == (1, 2, RATE)
        assert ours.readframes(10**7) == theirs.readframes(10**7) == reference.samples(LONG).tobytes()
    pcm = _speak(http, LONG, response_format="pcm")
    assert pcm.headers["content-type"] == "audio/pcm" and pcm.content == reference.written(LONG, "pcm")
    flac = _speak(http, LONG, response_format="flac")
    assert flac.content[:4] == b"fLaC" and np.array_equal(_decoded(flac.content), reference.samples(LONG))


@pytest.mark.slow
def test_speech_streams_a_segment_at_a_time(http, reference):
    """OpenAI's SSE events: a delta per piece as the runner makes them. The first segment's comes
    out while the other four are still being made: before half the speech's time has gone, counted
    from the answer's headers (sent once the runner accepted the request, the model loaded)."""
    arrivals: list[tuple[float, dict[str, Any]]] = []
    body = {"model": SPEECH_MODEL_ID, "input": LONGER, "voice": "nova", "response_format": "pcm", "stream_format": "sse"}
    with http.stream("POST", "/v1/audio/speech", json=body) as answer:
        asked_at = time.monotonic()
        assert answer.headers["content-type"] == "text/event-stream"
        for line in answer.iter_lines():
            if line.startswith("data: "):
                arrivals.append((time.monotonic(), json.loads(line[6:])))
    *deltas, (done_at, done) = arrivals
    assert {event["type"] for _, event in deltas} == {"speech.audio.delta"}
    assert b"".join(base64.b64decode(event["audio"]) for _, event in deltas) == reference.written(LONGER, "pcm")
    assert len(deltas) >= len(reference.segments(LONGER)) == 5
    input_tokens = len(reference.model.tokenizer.encode(LONGER))  # the model's own tokenizer (transformers')
    assert done["type"] == "speech.audio.done" and done["usage"]["output_tokens"] > 0
    assert done["usage"] == {"input_tokens": input_tokens, "output_tokens": done["usage"]["output_tokens"],
                             "total_tokens": input_tokens + done["usage"]["output_tokens"]}
    assert deltas[0][0] - asked_at < (done_at - asked_at) / 2, (deltas[0][0] - asked_at, done_at - asked_at)


@pytest.mark.slow
def test_open_webui_and_the_openai_client_are_answered(http, node, reference):
    # Open WebUI posts {"input", "voice", "model"} plus its admin's TTS_OPENAI_PARAMS (none by default),
    # stores the answer as .mp3 and serves it back: the browser reads a WAV by its bytes.
    webui = http.post("/v1/audio/speech", json={"input": SHORT, "voice": "alloy", "model": SPEECH_MODEL_ID})
    assert webui.status_code == 200 and webui.content[:4] == b"RIFF"
    assert webui.content[44:] == reference.written(SHORT, "pcm")
    client = openai.OpenAI(base_url=f"{node.url}/v1", api_key="none", max_retries=0)
    spoken = client.audio.speech.create(model=SPEECH_MODEL_ID, voice="alloy", input=SHORT, response_format="pcm")
    assert spoken.content == reference.written(SHORT, "pcm")


@pytest.mark.slow
@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"voice": "nobody"}, "voice", "voice 'nobody' is not one this model answers to"),
    ({"speed": 2.0}, "speed", "speed 2 is not one this model can do"),
    ({"speed": 5}, "speed", "speed must be between 0.25 and 4.0"),
    ({"response_format": "mp3"}, "response_format", "needs an encoder exo does not ship (ffmpeg)"),
    ({"input": "y" * (MAX_CHARS + 1)}, "input", f"at most {MAX_CHARS} (EXO_MAX_SPEECH_CHARS)"),
    ({"model": TINY_MODEL_ID}, "model", "does not turn text into speech"),
    ({"voices": "alloy"}, None, "unknown field `voices`; did you mean `voice`?"),  # decode_body names no param
])
def test_bad_requests_are_400s_that_name_the_field(http, fields, param, message):
    answer = http.post("/v1/audio/speech", json={"model": SPEECH_MODEL_ID, "input": SHORT, **fields})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and message in error["message"], error


@pytest.mark.slow
def test_other_routes_refuse_what_a_speech_model_does_not_serve(http):
    chat = http.post("/v1/chat/completions", json={"model": SPEECH_MODEL_ID, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "is a text-to-speech model" in chat.text and "/v1/audio/speech" in chat.text
    placed = http.post("/place_instance", json={"model_id": SPEECH_MODEL_ID, "min_nodes": 2})
    assert placed.status_code == 409 and "a text-to-speech model runs on one node" in placed.text
    assert http.get(f"/v1/models/{SPEECH_MODEL_ID}").json()["card"]["speaks"] is True


def _audio_seconds_counted(metrics: str) -> float:
    found = re.search(rf'^exo_audio_seconds_total{{model="{re.escape(SPEECH_MODEL_ID)}"}} (\S+)$', metrics, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.mark.slow
def test_a_keys_speech_counts_its_seconds_in_usage_and_metrics(http, node, reference):
    """Last in the module: while the key exists, every request to the node needs one."""
    seconds = len(reference.samples(SHORT)) / RATE
    before = _audio_seconds_counted(http.get("/metrics").text)
    added = http.post("/keys", json={"name": "speaker", "admin": True})  # admin: it reads /metrics, deletes itself
    assert added.status_code == 200, added.text
    key_id, secret = added.json()["key"]["key_id"], added.json()["secret"]
    with httpx.Client(base_url=node.url, timeout=300, headers={"Authorization": f"Bearer {secret}"}) as keyed:
        try:
            assert _speak(keyed).status_code == 200
            assert _audio_seconds_counted(keyed.get("/metrics").text) == pytest.approx(before + seconds)
            rows = wait_until(lambda: [r for r in keyed.get(f"/usage?key_id={key_id}").json()["data"]
                                       if r["audio_seconds"]], 10, what="the speech in the key's usage")
        finally:
            deleted = keyed.delete(f"/keys/{key_id}")
    assert deleted.status_code == 200, deleted.text
    assert [(r["model"], r["requests"], r["audio_seconds"]) for r in rows] == [(SPEECH_MODEL_ID, 1, pytest.approx(seconds))]
