"""Images on every surface that carries them, against `exo` as a process: OpenAI chat `image_url`
parts, Responses `input_image` parts, Anthropic `image` blocks, Ollama `images` on /api/chat and
/api/generate. Each request's images reach its task in order (read from the event log: a finished
task's params lose their messages) and are in the object store; a model that takes no images, bad
base64, URLs and images outside user messages are 400s in the surface's shape.

The card that takes images points at the tiny text llama, whose runner may refuse them (it has no
vision tower), so neither the answer nor its status is asserted here (exactness against mlx-vlm is
tested elsewhere): a task created with the images is what says the API took them."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable

import pytest
from nats.js.errors import ObjectNotFoundError

from exo.api.errors import ApiError
from exo.api.images import ImageUploads
from exo.bus.connection import connect
from exo.bus.images import image_digest
from exo.bus.subjects import IMAGES_BUCKET
from exo.core.events import TaskCreated
from exo.settings.services import ApiSettings
from tests.support.cluster import replay
from tests.support.e2e import nats_url_of, one_model_node, place
from tests.support.image_server import ImageServer
from tests.support.images import random_png
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model

pytestmark = pytest.mark.slow

VISION = "local/vision"  # the tiny llama under a card that takes images
TEXT = "local/text-only"  # the same model under a card that does not
ASK = "What is in these pictures?"
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}

model_dir, node = one_model_node(TINY_MODEL_ID, make_tiny_model)


@pytest.fixture(scope="module")
def cards(http, model_dir) -> None:
    for card in [{"model_id": VISION, "path": str(model_dir), "supports_images": True},
                 {"model_id": TEXT, "path": str(model_dir)}]:
        assert http.post("/models/add", json=card).status_code == 200
    place(http, VISION)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(image: str) -> str:
    return "data:image/png;base64," + image


def _chat(model: str, images: list[str]) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return {"model": model, "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "text", "text": ASK}, *parts]}]}


def _responses(model: str, images: list[str]) -> dict:
    parts = [{"type": "input_image", "image_url": data_url(i), "detail": "low"} for i in images]
    return {"model": model, "max_output_tokens": 2,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": ASK}, *parts]}]}


def _messages(model: str, images: list[str]) -> dict:
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": i}} for i in images]
    return {"model": model, "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "text", "text": ASK}, *blocks]}]}


def _ollama_chat(model: str, images: list[str]) -> dict:
    return {"model": model, "stream": False, "options": {"num_predict": 2},
            "messages": [{"role": "user", "content": ASK, "images": images}]}


def _ollama_generate(model: str, images: list[str]) -> dict:
    return {"model": model, "stream": False, "options": {"num_predict": 2}, "prompt": ASK, "images": images}


# surface: (route, error shape, request with these base64 images)
SURFACES: dict[str, tuple[str, str, Callable[[str, list[str]], dict]]] = {
    "chat": ("/v1/chat/completions", "openai", _chat),
    "responses": ("/v1/responses", "openai", _responses),
    "messages": ("/v1/messages", "anthropic", _messages),
    "ollama-chat": ("/api/chat", "ollama", _ollama_chat),
    "ollama-generate": ("/api/generate", "ollama", _ollama_generate),
}


def error_of(response, shape: str) -> str:
    """The error message, once the body is in the surface's own error shape."""
    body = response.json()
    if shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        return body["error"]["message"]
    if shape == "ollama":
        assert isinstance(body["error"], str), body
        return body["error"]
    assert body["error"]["type"] == "invalid_request_error", body
    return body["error"]["message"]


def images_of_tasks_since(http, node, since: int) -> list[list[list[str]]]:
    """For each task created after event `since`: the images of each of its messages that has some."""
    _, events = replay(nats_url_of(node), http.get("/state").json()["last_seq"])
    return [[m.images for m in event.task.params.messages if m.images]
            for seq, event, _ in events if seq > since and isinstance(event, TaskCreated)]


def in_store(node, digests: list[str]) -> list[bool]:
    async def check() -> list[bool]:
        nc = await connect([nats_url_of(node)], name="image-check")
        try:
            store = await nc.jetstream().object_store(IMAGES_BUCKET)
            found = []
            for digest in digests:
                try:
                    found.append((await store.get_info(digest)).size > 0)
                except ObjectNotFoundError:
                    found.append(False)
            return found
        finally:
            await nc.close()

    return asyncio.run(check())


def two_images() -> tuple[list[str], list[str]]:
    images = [random_png(3000), random_png(2000)]
    return [b64(i) for i in images], [image_digest(i) for i in images]


@pytest.mark.parametrize("surface", SURFACES)
def test_two_images_reach_the_task_in_order_and_the_object_store(http, node, cards, surface):
    path, _, request = SURFACES[surface]
    encoded, digests = two_images()
    since = http.get("/state").json()["last_seq"]
    http.post(path, json=request(VISION, encoded))
    assert images_of_tasks_since(http, node, since) == [[digests]]
    assert in_store(node, digests) == [True, True]


@pytest.mark.parametrize("surface", SURFACES)
def test_a_model_that_takes_no_images_refuses_them_and_nothing_is_stored(http, node, cards, surface):
    path, shape, request = SURFACES[surface]
    encoded, digests = two_images()
    response = http.post(path, json=request(TEXT, encoded))
    assert response.status_code == 400, response.text
    assert f"the model {TEXT!r} does not take image inputs" in error_of(response, shape)
    assert in_store(node, digests) == [False, False]


@pytest.mark.parametrize("surface", SURFACES)
def test_bad_base64_is_400(http, cards, surface):
    path, shape, request = SURFACES[surface]
    response = http.post(path, json=request(VISION, [b64(b"fine"), "not*base64"]))
    assert response.status_code == 400, response.text
    assert "not valid base64" in error_of(response, shape)


@pytest.mark.parametrize("surface", SURFACES)
def test_a_damaged_image_is_400_and_nothing_is_stored(http, node, cards, surface):
    path, shape, request = SURFACES[surface]
    good, truncated = random_png(3000), random_png(3000)[:-300]
    response = http.post(path, json=request(VISION, [b64(good), b64(truncated)]))
    assert response.status_code == 400, response.text
    assert "image 2 of the request is damaged" in error_of(response, shape)
    assert in_store(node, [image_digest(good), image_digest(truncated)]) == [False, False]


def test_bad_base64_names_where_it_is(http, cards):
    for path, request, param in [("/v1/chat/completions", _chat, "messages[0].content[2]"),
                                 ("/v1/responses", _responses, "input[0].content[2].image_url")]:
        response = http.post(path, json=request(VISION, [b64(b"fine"), "%%%"]))
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize("path, shape, part, param", [
    ("/v1/chat/completions", "openai", lambda url: {"type": "image_url", "image_url": {"url": url}}, "messages[0].content[0]"),
    ("/v1/responses", "openai", lambda url: {"type": "input_image", "image_url": url}, "input[0].content[0].image_url"),
    ("/v1/messages", "anthropic", lambda url: {"type": "image", "source": {"type": "url", "url": url}},
     "messages[0].content[0].source.url"),
])
def test_image_urls_to_loopback_are_refused_unrequested_without_image_url_private(http, cards, path, shape, part, param):
    with ImageServer(b"an image") as server:
        url = server.url + "/image.png"
        turns = [{"role": "user", "content": [part(url)]}]
        body = {"input": turns} if path == "/v1/responses" else {"max_tokens": 2, "messages": turns}
        response = http.post(path, json={"model": VISION, **body})
        assert response.status_code == 400, response.text
        assert error_of(response, shape) == (f"the image at {url} could not be fetched: 127.0.0.1 is a refused address "
                                             "(loopback); set EXO_IMAGE_URL_PRIVATE=1 to allow such addresses")
        assert server.total_hits == 0
    if shape == "openai":
        assert response.json()["error"]["param"] == param


TOOL_USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "camera", "input": {}}]}


# Vision models see images in user turns only: elsewhere they are refused before anything is stored.
@pytest.mark.parametrize("path, shape, body, message", [
    ("/v1/responses", "openai", {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
     "file_id is not supported"),
    ("/v1/responses", "openai", {"input": [{"role": "system", "content": [
        {"type": "input_image", "image_url": data_url("AAAA")}]}]}, "user messages only"),
    ("/v1/responses", "openai", {"input": [
        {"type": "function_call", "call_id": "c1", "name": "camera", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_image", "image_url": data_url("AAAA")}]}]}, "user messages only"),
    ("/v1/messages", "anthropic", {"max_tokens": 2, "messages": [{"role": "assistant", "content": [IMAGE]}]},
     "not supported in a assistant message"),
    ("/v1/messages", "anthropic", {"max_tokens": 2, "messages": [{"role": "user", "content": "x"}, TOOL_USE, {
        "role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [IMAGE]}]}]},
     "user messages only"),
    ("/v1/messages", "anthropic", {"max_tokens": 2, "system": [IMAGE], "messages": [{"role": "user", "content": "x"}]},
     "user messages only"),
    ("/api/generate", "ollama", {"prompt": "x", "raw": True, "images": ["AAAA"]}, "raw: true"),
    ("/api/chat", "ollama", {"messages": [{"role": "assistant", "content": "x", "images": ["AAAA"]}]},
     "user messages only"),
])
def test_images_where_they_cannot_go_are_400(http, cards, path, shape, body, message):
    response = http.post(path, json={"model": VISION, **body})
    assert response.status_code == 400, response.text
    assert message in error_of(response, shape)


def test_data_urls_and_bare_base64_share_one_decoding_and_its_limits():
    uploads = ImageUploads(ApiSettings(max_image_bytes=8))
    assert uploads.add_image_url(data_url(b64(b"12345678")), "a") == uploads.add_base64(b64(b"12345678"), "b")
    assert list(uploads.by_digest) == [image_digest(b"12345678")]
    for add, payload, status in [(uploads.add_base64, b64(b"123456789"), 413), (uploads.add_base64, "", 400),
                                 (uploads.add_image_url, data_url("###"), 400), (uploads.add_image_url, "file:///x", 400)]:
        with pytest.raises(ApiError) as refused:
            add(payload, "p")
        assert (refused.value.status, refused.value.param) == (status, "p")
