"""Request subjects decode strictly and check ranges where a value enters: an event can never
pass for a request, and no request can ask a node for more than one chunk's worth of memory."""

from __future__ import annotations

import msgspec
import pytest

from exo.bus.peers.download_control import DownloadRequest
from exo.bus.peers.model_share import MAX_CHUNK, ShareRequest
from exo.core.events import CustomCardDeleted, DownloadFailed, encode_event


@pytest.mark.parametrize("event", [CustomCardDeleted(model_id="org/m"),
                                   DownloadFailed(node_id="n1", model_id="org/m", reason="x")])
def test_a_stored_event_is_not_a_request(event):
    for request_type in (DownloadRequest, ShareRequest):
        with pytest.raises(msgspec.ValidationError, match="unknown field"):
            msgspec.json.decode(encode_event(event), type=request_type)


@pytest.mark.parametrize("fields", [{"length": -1}, {"length": MAX_CHUNK + 1}, {"offset": -5}, {"path": "x" * 5000}])
def test_a_chunk_request_out_of_range_is_refused(fields):
    request = {"model_id": "org/m", "path": "model.safetensors", "offset": 0, "length": 1024, **fields}
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode(request), type=ShareRequest)


def test_requests_in_range_decode():
    request = {"model_id": "org/m", "path": "model.safetensors", "offset": 10, "length": MAX_CHUNK}
    assert msgspec.json.decode(msgspec.json.encode(request), type=ShareRequest) == ShareRequest(**request)
    assert msgspec.json.decode(b'{"model_id":"org/m"}', type=DownloadRequest) == DownloadRequest(model_id="org/m")


def test_urls_in_messages_never_show_a_password():
    from exo.bus.connection import redact, split_urls

    assert redact("nats://exo:s3cret@10.0.0.1:4222") == "nats://10.0.0.1:4222"
    assert redact("nats://exo:p@ss@host") == "nats://host"  # the last @ ends the user part
    assert redact("tls://[::1]:4222") == "tls://[::1]:4222"
    # A password holding a comma is split by the URL list: no piece may show any of it.
    pieces = split_urls('nats://exo:{"exo_password":"abc", "operator_password":"def"}@127.0.0.1:4300')
    assert all("abc" not in redact(p) and "def" not in redact(p) for p in pieces)


def test_a_model_id_suggestion_names_a_near_one_and_skips_what_is_no_id():
    from exo.api.context import closest_model_id

    known = ["mlx-community/Qwen3-0.6B-4bit", "mlx-community/SmolLM2-135M-Instruct"]
    assert closest_model_id("mlx-community/qwen3-0.6b-4bit", known) == known[0]  # case
    assert closest_model_id("someone/SmolLM2-135M-Instruct", known) == known[1]  # another org
    assert closest_model_id("mlx-community/SmolLM2-135M-Instruc", known) == known[1]  # spelling
    assert closest_model_id("org/unrelated", known) is None
    assert closest_model_id("a/" + "b" * 5000, known) is None
