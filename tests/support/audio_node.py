"""One exo node serving an audio model (placed) and the tiny chat model (added), for the audio
routes' tests: the chat model is there to be refused by them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.support.e2e import exo_serving, place
from tests.support.exo_process import ExoProcess
from tests.support.tiny_model import TINY_MODEL_ID, make_tiny_model


@contextmanager
def audio_node(tmp_path_factory: pytest.TempPathFactory, model_id: str, folder: Path,
               env: dict[str, str]) -> Iterator[ExoProcess]:
    chat = make_tiny_model(tmp_path_factory.mktemp("chat") / "tiny")
    with exo_serving(tmp_path_factory.mktemp("node"), {model_id: folder, TINY_MODEL_ID: chat}, env) as exo:
        yield exo


@contextmanager
def audio_client(node: ExoProcess, model_id: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=node.url, timeout=300) as client:
        place(client, model_id)
        assert client.post("/models/add", json={"model_id": TINY_MODEL_ID}).status_code == 200
        yield client
