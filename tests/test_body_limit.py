"""A request body is bounded by what one NATS message of the connected server carries (the request's
text goes into one command): a body over it is a 413 naming the limit, from its Content-Length
before any of it is read, or as soon as a chunked body passes it, never read whole first."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from aiohttp.test_utils import TestServer

from exo.api.app import build_app
from exo.api.context import COMMAND_ROOM_BYTES, ApiContext
from exo.bus.connection import Connection, connect
from exo.bus.server.embedded import MAX_PAYLOAD_BYTES, nats_server_binary
from exo.core.state import State
from exo.settings.services import ApiSettings
from tests.support.exo_process import free_port

PLAIN_NATS_MAX_PAYLOAD = 1024 * 1024  # nats-server's default, for a user's own server
LIMIT = PLAIN_NATS_MAX_PAYLOAD - COMMAND_ROOM_BYTES
ANSWER_S = 5.0  # the 413 comes at once; the body it refuses never finishes


@pytest.fixture
def plain_nats() -> Iterator[str]:
    port = free_port()
    server = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield f"nats://127.0.0.1:{port}"
    server.terminate()
    server.wait(10)


def api_context(nc: Connection, tmp_path: Path, settings: ApiSettings = ApiSettings()) -> ApiContext:
    return ApiContext(nc=nc, view=SimpleNamespace(state=State()), outcomes=None,  # type: ignore[arg-type]
                      builtin_cards={}, node_id="", data_dir=tmp_path, settings=settings)


@pytest.fixture
async def api(plain_nats: str, tmp_path: Path) -> AsyncIterator[TestServer]:
    nc = await connect([plain_nats], "exo-test")
    server = TestServer(build_app(api_context(nc, tmp_path)))
    await server.start_server()
    yield server
    await server.close()
    await nc.close()


async def test_the_limit_follows_the_connected_servers_max_payload_unless_set(plain_nats, nc, tmp_path):
    plain = await connect([plain_nats], "exo-test")
    try:
        assert api_context(plain, tmp_path).body_limit() == LIMIT
    finally:
        await plain.close()
    assert api_context(nc, tmp_path).body_limit() == MAX_PAYLOAD_BYTES - COMMAND_ROOM_BYTES  # the embedded server's
    assert api_context(nc, tmp_path, ApiSettings(max_body_bytes=5000)).body_limit() == 5000


def chat_body(size: int) -> bytes:
    """A chat request of exactly `size` bytes, for a model nobody has."""
    empty = json.dumps({"model": "nobody/nothing", "messages": [{"role": "user", "content": ""}]}).encode()
    return empty.replace(b'"content": ""', b'"content": "' + b"x" * (size - len(empty)) + b'"')


async def test_a_body_at_the_limit_is_read_and_one_byte_more_is_a_413_naming_it(api):
    async with httpx.AsyncClient(base_url=str(api.make_url("")), timeout=30) as http:
        at_limit = await http.post("/v1/chat/completions", content=chat_body(LIMIT))
        assert at_limit.status_code == 404 and at_limit.json()["error"]["code"] == "model_not_found"
        over = await http.post("/v1/chat/completions", content=chat_body(LIMIT + 1))
        assert over.status_code == 413
        assert over.json()["error"] == {
            "message": f"the request body is larger than this server's limit of {LIMIT} bytes (EXO_MAX_BODY_BYTES; by "
                       "default what one NATS message carries: the server's max_payload less 64 KiB)",
            "type": "invalid_request_error", "param": None, "code": "request_too_large"}
        ollama = await http.post("/api/chat", content=chat_body(LIMIT + 1))
        assert ollama.status_code == 413 and f"limit of {LIMIT} bytes" in ollama.json()["error"]


async def status_and_body(api: TestServer, head: str, body: bytes) -> tuple[int, dict]:
    """Send `head` and `body`, then nothing more (the body is never finished): the server's answer."""
    reader, writer = await asyncio.open_connection(api.host, api.port)
    try:
        writer.write(head.encode() + body)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), ANSWER_S)
        headers = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), ANSWER_S)).decode().lower()
        length = int(headers.split("content-length: ", 1)[1].split("\r\n", 1)[0])
        return int(status_line.split()[1]), json.loads(await asyncio.wait_for(reader.readexactly(length), ANSWER_S))
    finally:
        writer.close()


async def test_a_content_length_over_the_limit_is_refused_before_the_body_comes(api):
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {LIMIT + 1}\r\n\r\n")
    status, body = await status_and_body(api, head, b'{"model": "')  # and the rest never comes
    assert status == 413 and f"limit of {LIMIT} bytes" in body["error"]["message"]


async def test_a_chunked_body_is_refused_once_it_passes_the_limit_without_waiting_for_its_end(api):
    head = "POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunk = b"x" * (64 * 1024)
    chunks = LIMIT // len(chunk) + 1  # one more than fits
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(chunks))  # and no last, empty chunk
    status, answer = await status_and_body(api, head, body)
    assert status == 413 and answer["type"] == "error" and answer["error"]["type"] == "request_too_large"
    assert f"limit of {LIMIT} bytes" in answer["error"]["message"]
