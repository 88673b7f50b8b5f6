"""Images by http(s) URL (exo/api/image_fetch.py): the address classes the guard refuses, as a
pure function over literal addresses (a public one passes it and is never fetched: these tests
send nothing beyond loopback); fetches against a local server on 127.0.0.1 (tests/support/
image_server.py) with each limit crossed, the refused ones leaving its request count at 0; and,
against `exo` as a process with EXO_IMAGE_URL_PRIVATE=1, an image sent by URL on each surface
answered exactly as the same image sent as base64."""

from __future__ import annotations

import base64
import ipaddress

import pytest

from exo.api.errors import ApiError
from exo.api.image_fetch import ByteBudget, FetchLimits, ImageFetchError, fetch_image, refused_class
from exo.api.images import ImageUploads
from exo.bus.images import image_digest
from exo.core.requests import ChatMessage, GenerationParams
from exo.settings.services import ApiSettings
from tests.support.e2e import exo_serving, place
from tests.support.image_server import ImageServer
from tests.support.vision_model import VISION_MODEL_ID, make_vision_model, png

IMAGE = png(7)
PARAM = "messages[0].content[1]"


@pytest.mark.parametrize("address, why", [
    ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("172.31.255.255", "private"), ("192.168.1.1", "private"),
    ("127.0.0.1", "loopback"), ("127.255.0.9", "loopback"), ("169.254.169.254", "link-local"),
    ("100.64.0.1", "shared (carrier-grade NAT)"), ("100.127.255.255", "shared (carrier-grade NAT)"),
    ("0.0.0.0", "unspecified"), ("0.1.2.3", "unspecified"), ("224.0.0.1", "multicast"), ("239.255.255.250", "multicast"),
    ("240.0.0.1", "reserved"), ("255.255.255.255", "reserved"),
    ("192.0.2.1", "special-purpose (not globally routable)"), ("198.18.0.1", "special-purpose (not globally routable)"),
    ("::1", "loopback"), ("::", "unspecified"), ("fe80::1", "link-local"), ("fe80::1%eth0", "link-local"),
    ("fc00::1", "unique-local (private)"), ("fd12:3456::1", "unique-local (private)"), ("fec0::1", "site-local (private)"),
    ("ff02::1", "multicast"), ("64:ff9b:1::1", "local-use NAT64 (private)"),
    ("2001:db8::1", "special-purpose (not globally routable)"), ("2001::1", "special-purpose (not globally routable)"),
    ("::ffff:127.0.0.1", "loopback, as IPv4 127.0.0.1"), ("::ffff:10.0.0.1", "private, as IPv4 10.0.0.1"),
    ("::127.0.0.1", "loopback, as IPv4 127.0.0.1"),  # IPv4-compatible
    ("2002:7f00:1::1", "loopback, as IPv4 127.0.0.1"),  # 6to4
    ("2002:a9fe:a9fe::1", "link-local, as IPv4 169.254.169.254"),
    ("64:ff9b::a00:1", "private, as IPv4 10.0.0.1"), ("64:ff9b::7f00:1", "loopback, as IPv4 127.0.0.1"),  # NAT64
])
def test_each_private_or_special_address_class_is_refused_by_name(address, why):
    assert refused_class(ipaddress.ip_address(address)) == why


# Public addresses, and the neighbours of the private ranges' edges: passed by the function, never fetched here.
@pytest.mark.parametrize("address", ["93.184.216.34", "8.8.8.8", "172.15.255.255", "172.32.0.1", "100.63.255.255",
                                     "100.128.0.0", "169.253.255.255", "2606:4700:4700::1111", "::ffff:93.184.216.34",
                                     "2002:5db8:d822::1", "64:ff9b::5db8:d822"])
def test_public_addresses_pass_the_guard(address):
    assert refused_class(ipaddress.ip_address(address)) is None


@pytest.fixture
def server():
    with ImageServer(IMAGE, big_bytes=4096) as running:
        yield running


async def fetched(urls: list[str], **limits) -> tuple[GenerationParams, ImageUploads]:
    """The images at `urls` fetched as one request's, under ApiSettings(**limits)."""
    uploads = ImageUploads(ApiSettings(**limits))
    message = ChatMessage(role="user", content="look", images=[uploads.add_image_url(u, PARAM) for u in urls])
    return await uploads.with_fetched_images(GenerationParams(messages=[message])), uploads


async def refusal(url: str, **limits) -> str:
    with pytest.raises(ApiError) as refused:
        await fetched([url], **limits)
    assert (refused.value.status, refused.value.param) == (400, PARAM)
    return refused.value.message


REFUSED = "a refused address ({}); set EXO_IMAGE_URL_PRIVATE=1 to allow such addresses"


@pytest.mark.parametrize("host, reasons", [
    ("127.0.0.1", {"127.0.0.1 is " + REFUSED.format("loopback")}),
    ("localhost", {f"localhost resolves to {a}, " + REFUSED.format("loopback") for a in ("127.0.0.1", "::1")}),
    ("[::ffff:127.0.0.1]", {"::ffff:7f00:1 is " + REFUSED.format("loopback, as IPv4 127.0.0.1")}),
    ("[::1]", {"::1 is " + REFUSED.format("loopback")}),
    ("0.0.0.0", {"0.0.0.0 is " + REFUSED.format("unspecified")}),
    # Numeric forms that socket maps onto 127.0.0.1: aiohttp refuses them, else the resolver would.
    ("127.1", {"the request failed: 127.1 - is not a canonical IPv4 address",
               "127.1 resolves to 127.0.0.1, " + REFUSED.format("loopback")}),
    ("2130706433", {"the request failed: 2130706433 - is not a canonical IPv4 address",
                    "2130706433 resolves to 127.0.0.1, " + REFUSED.format("loopback")}),
])
async def test_a_loopback_url_is_refused_and_no_request_is_sent(server, host, reasons):
    url = server.url.replace("127.0.0.1", host) + "/image.png"
    message = await refusal(url)
    assert message.removeprefix(f"the image at {url} could not be fetched: ") in reasons, message
    assert server.total_hits == 0


async def test_with_private_allowed_the_image_is_fetched_and_its_placeholder_becomes_its_digest(server):
    params, uploads = await fetched([server.url + "/image.png", "data:image/png;base64," + base64.b64encode(png(8)).decode()],
                                    image_url_private=True)
    assert params.messages[0].images == [image_digest(IMAGE), image_digest(png(8))]
    assert uploads.by_digest == {image_digest(IMAGE): IMAGE, image_digest(png(8)): png(8)}
    assert server.hits["/image.png"] == 1


async def test_the_urls_of_one_request_are_fetched_at_once(server):
    # /together answers only while a second request is in: one after the other, the first would fail.
    params, _ = await fetched([server.url + "/together?n=1", server.url + "/together?n=2"], image_url_private=True)
    assert params.messages[0].images == [image_digest(IMAGE)] * 2


@pytest.mark.parametrize("path, limits, reason", [
    ("/big", {"max_image_bytes": 4000}, "it is 4100 bytes, over the limit of 4000 (EXO_MAX_IMAGE_BYTES)"),
    ("/big?unsized=1", {"max_image_bytes": 4000}, "it is larger than the limit of 4000 bytes (EXO_MAX_IMAGE_BYTES)"),
    ("/slow?s=3", {"image_url_timeout_s": 0.5}, "it took longer than 0.5 s (EXO_IMAGE_URL_TIMEOUT_S)"),
    ("/hops/4", {}, "more than 3 redirects"),
    ("/text", {}, "its content type is 'text/plain', not an image/* type"),
    ("/status?code=404", {}, "the server answered HTTP 404"),
    ("/to?url=ftp://127.0.0.1/x.png", {}, "only http and https URLs with a host are fetched, not 'ftp://127.0.0.1/x.png'"),
])
async def test_each_limit_crossed_is_a_400_naming_the_url_and_the_cause(server, path, limits, reason):
    message = await refusal(server.url + path, image_url_private=True, **limits)
    assert message == f"the image at {server.url + path} could not be fetched: {reason}"


async def test_three_redirects_are_followed(server):
    params, _ = await fetched([server.url + "/hops/3"], image_url_private=True)
    assert params.messages[0].images == [image_digest(IMAGE)]
    assert [server.hits[f"/hops/{n}"] for n in (3, 2, 1)] == [1, 1, 1]


async def test_the_fetches_of_a_request_share_its_byte_limit(server):
    # Each 4100-byte image is under the cap of one image; the two fetches together cross the
    # request's (they are one image, so only the bytes fetched, not those kept, can cross it).
    with pytest.raises(ApiError) as refused:
        await fetched([server.url + "/big?n=1", server.url + "/big?n=2"], image_url_private=True,
                      max_request_image_bytes=6000)
    assert refused.value.message.endswith("could not be fetched: the images of the request total more than "
                                          "EXO_MAX_REQUEST_IMAGE_BYTES")


def test_more_urls_than_the_image_cap_are_refused_before_any_is_fetched(server):
    uploads = ImageUploads(ApiSettings(max_images=2, image_url_private=True))
    uploads.add_image_url(server.url + "/image.png?n=1", "a")
    uploads.add_image_url(server.url + "/image.png?n=1", "b")  # the same URL again: one image
    uploads.add_image_url(server.url + "/image.png?n=2", "c")
    with pytest.raises(ApiError) as refused:
        uploads.add_image_url(server.url + "/image.png?n=3", "d")
    assert (refused.value.status, refused.value.message, refused.value.param) == (400, "at most 2 images in one request", "d")


async def test_a_redirect_from_an_allowed_address_to_a_refused_one_is_not_followed(server):
    # 127.0.0.1 stands in for a public server (the only address let through here) and 127.0.0.2
    # for the private one it redirects to: both loopback, so nothing leaves this machine.
    with ImageServer(IMAGE, host="127.0.0.2") as private:
        limits = FetchLimits(max_bytes=1 << 20, timeout_s=10, allowed=(ipaddress.ip_network("127.0.0.1/32"),))
        assert await fetch_image(server.url + "/image.png", limits, ByteBudget(1 << 20)) == IMAGE  # the allowed one works
        with pytest.raises(ImageFetchError) as refused:
            await fetch_image(f"{server.url}/to?url={private.url}/image.png", limits, ByteBudget(1 << 20))
        assert str(refused.value) == "127.0.0.2 is " + REFUSED.format("loopback")
        assert private.total_hits == 0
        assert server.hits["/to"] == 1


# End to end: exo with EXO_IMAGE_URL_PRIVATE=1, so it may fetch from this machine's loopback server.
ASK = "What is in this picture?"
TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_vision_model(tmp_path_factory.mktemp("model") / "model")


@pytest.fixture(scope="module")
def node(tmp_path_factory, model_dir):
    with exo_serving(tmp_path_factory.mktemp("node"), {VISION_MODEL_ID: model_dir}, {"EXO_IMAGE_URL_PRIVATE": "1"}) as exo:
        yield exo


@pytest.fixture(scope="module")
def placed(http):
    place(http, VISION_MODEL_ID)


def _answer(http, path: str, image_part: dict) -> str:
    """The greedy answer to ASK and one image, on the surface at `path`."""
    if path == "/v1/responses":
        body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": ASK}, image_part]}],
                "max_output_tokens": TOKENS}
    else:
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": ASK}, image_part]}], "max_tokens": TOKENS}
    reply = http.post(path, json={"model": VISION_MODEL_ID, "temperature": 0, **body})
    assert reply.status_code == 200, reply.text
    found = reply.json()
    if path == "/v1/chat/completions":
        return str(found["choices"][0]["message"]["content"])
    if path == "/v1/messages":
        return str(found["content"][0]["text"])
    return str(found["output"][-1]["content"][0]["text"])


def _parts(url: str) -> list[tuple[str, dict]]:
    """Each surface's image part for `url`, an http(s) or a data: URL (Anthropic's as a base64 source for the latter)."""
    data = url.partition(",")[2]
    anthropic_source = {"type": "base64", "media_type": "image/png", "data": data} if data else {"type": "url", "url": url}
    return [("/v1/chat/completions", {"type": "image_url", "image_url": {"url": url}}),
            ("/v1/messages", {"type": "image", "source": anthropic_source}),
            ("/v1/responses", {"type": "input_image", "image_url": url})]


def _data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


@pytest.mark.slow
def test_an_image_by_url_is_answered_as_the_same_image_in_base64_on_every_surface(http, placed, server):
    by_url = [_answer(http, path, part) for path, part in _parts(server.url + "/image.png")]
    assert by_url == [_answer(http, path, part) for path, part in _parts(_data_url(IMAGE))]
    assert server.hits["/image.png"] == 3
    assert by_url[0] != _answer(http, *_parts(_data_url(png(8)))[0])  # another image, another answer: the image is seen


@pytest.mark.slow
def test_a_url_that_is_no_image_is_a_400_naming_where_it_is(http, placed, server):
    part = {"type": "image_url", "image_url": {"url": server.url + "/text"}}
    turns = [{"role": "user", "content": [{"type": "text", "text": ASK}, part]}]
    reply = http.post("/v1/chat/completions", json={"model": VISION_MODEL_ID, "messages": turns})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == PARAM
    assert reply.json()["error"]["message"] == (f"the image at {server.url}/text could not be fetched: its content type is "
                                                "'text/plain', not an image/* type")
