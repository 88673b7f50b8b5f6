"""Images reach the model: a tiny Qwen2-VL (tests/support/vision_model.py) served by `exo` as a
process, its card added from the (fake) Hub and detected as a vision model. Greedy answers through
every surface that carries images equal mlx-vlm's own for the same prompt and images, token for
token; two images give two different answers (so the image is really seen)."""

from __future__ import annotations

import base64
import json

import pytest

from tests.support.cluster import wait_until
from tests.support.e2e import one_model_node, place
from tests.support.vision_model import VISION_MODEL_ID, VisionReference, make_vision_model, png

pytestmark = pytest.mark.slow

ASK = "What is in this picture?"
TOKENS = 16
A, B = png(1), png(2)
IMAGES = {"A": [A], "B": [B], "AB": [A, B], "none": []}

model_dir, node = one_model_node(VISION_MODEL_ID, make_vision_model)


@pytest.fixture(scope="module")
def ref(http, model_dir, tmp_path_factory) -> VisionReference:
    place(http, VISION_MODEL_ID)
    return VisionReference(model_dir, tmp_path_factory.mktemp("images"))


@pytest.fixture(scope="module")
def answers(ref) -> dict[str, tuple[str, int]]:
    """mlx-vlm's answers: image A, image B, A then B, no image."""
    found = {name: ref.chat(ASK, images, TOKENS) for name, images in IMAGES.items()}
    assert len({text for text, _ in found.values()}) == 4  # each image changes the answer: the tests can fail
    return found


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def chat_body(*images: bytes, **extra) -> dict:
    parts = [{"type": "text", "text": ASK}] + [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return {"model": VISION_MODEL_ID, "messages": [{"role": "user", "content": parts}], "max_tokens": TOKENS,
            "temperature": 0, **extra}


@pytest.mark.parametrize("images", list(IMAGES))
def test_chat_completions_see_the_images_as_mlx_vlm_does(http, answers, images):
    reply = http.post("/v1/chat/completions", json=chat_body(*IMAGES[images]))
    assert reply.status_code == 200, reply.text
    text, prompt_tokens = answers[images]
    assert reply.json()["choices"][0]["message"]["content"] == text
    assert reply.json()["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": TOKENS,
                                     "total_tokens": prompt_tokens + TOKENS, **_details(reply.json()["usage"])}


def _details(usage: dict) -> dict:
    return {k: v for k, v in usage.items() if k.endswith("_details")}


def test_streamed_chat_with_an_image_equals_mlx_vlm(http, answers):
    with http.stream("POST", "/v1/chat/completions", json=chat_body(B, stream=True)) as reply:
        assert reply.status_code == 200
        events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == answers["B"][0]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_anthropic_messages_image_blocks_equal_mlx_vlm(http, answers):
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(A).decode()}}
    body = {"model": VISION_MODEL_ID, "max_tokens": TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "text", "text": ASK}, block]}]}
    reply = http.post("/v1/messages", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["content"][0]["text"] == answers["A"][0]


def test_ollama_chat_images_equal_mlx_vlm(http, answers):
    images = [base64.b64encode(i).decode() for i in (A, B)]
    body = {"model": VISION_MODEL_ID, "stream": False, "options": {"temperature": 0, "num_predict": TOKENS},
            "messages": [{"role": "user", "content": ASK, "images": images}]}
    reply = http.post("/api/chat", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["message"]["content"] == answers["AB"][0]


def test_a_vision_model_is_refused_on_two_nodes_with_the_reason(http, ref):
    refused = http.post("/place_instance", json={"model_id": VISION_MODEL_ID, "min_nodes": 2})
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["message"] == ("a vision model runs on one node (mlx-vlm cannot split a model "
                                                  "across nodes): min_nodes must be 1")


def test_bytes_that_are_no_image_are_refused_with_a_400(http, ref):
    reply = http.post("/v1/chat/completions", json=chat_body(A, b"GIF89a but not really an image"))
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["message"].startswith("image 2 of the request is not an image this model can read")


def test_a_stop_string_ends_the_answer_where_it_begins(http, answers):
    text = answers["A"][0]
    stop = text[5:9]
    reply = http.post("/v1/chat/completions", json=chat_body(A, stop=[stop])).json()
    assert reply["choices"][0]["message"]["content"] == text[:text.index(stop)]
    assert reply["choices"][0]["finish_reason"] == "stop"


def test_seeded_sampling_equals_mlx_vlm_after_that_seed(http, ref, answers):
    sampled, _ = ref.chat(ASK, [A], TOKENS, seed=42, temperature=1.5)
    assert sampled != answers["A"][0]  # sampling really changes the answer: the test can fail
    reply = http.post("/v1/chat/completions", json=chat_body(A, seed=42, temperature=1.5)).json()
    assert reply["choices"][0]["message"]["content"] == sampled


def test_a_stream_whose_client_leaves_is_cancelled_within_a_few_tokens(http, answers):
    with http.stream("POST", "/v1/chat/completions", json=chat_body(A, stream=True, max_tokens=20_000)) as reply:
        chunks = (json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {"))
        first = next(c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content"))  # generating
    command_id = first["id"].removeprefix("chatcmpl-")

    def ended_task() -> dict | None:
        task = http.get("/state").json()["tasks"][command_id]
        return task if task["status"] not in ("pending", "running") else None

    task = wait_until(ended_task, 30, 0.2, what=f"task {command_id} ended")
    assert task["status"] == "cancelled"
    assert 0 < task["completion_tokens"] < 20_000
