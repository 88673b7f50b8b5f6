"""Shared fixtures: a real nats-server per test session (free port, temp store dir)."""

from __future__ import annotations

import os
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest
import pytest_asyncio

from exo.bus.connection import connect
from exo.bus.provision import provision
from exo.bus.server.embedded import EmbeddedNats
from tests.support.e2e import start_exo
from tests.support.polling import eventually as eventually  # where tests import it from

# Every exo the tests start is standalone unless a test asks for discovery (tests/test_cluster_*.py):
# nodes of unrelated tests on one machine must not find each other and form a cluster.
os.environ.setdefault("EXO_DISCOVERY", "0")


@pytest_asyncio.fixture(scope="session")
async def nats_url(tmp_path_factory: pytest.TempPathFactory):
    server = EmbeddedNats(tmp_path_factory.mktemp("nats"), port=0)
    url = await server.start()
    yield url
    server.stop()


@pytest_asyncio.fixture
async def nc(nats_url: str):
    client = await connect([nats_url], name="exo-test")
    await provision(client)
    yield client
    await client.close()


@pytest_asyncio.fixture
async def fresh_server(tmp_path: Path):
    """A server of its own, for tests that change streams."""
    server = EmbeddedNats(tmp_path / "nats", port=0)
    await server.start()
    yield server
    server.stop()


@pytest_asyncio.fixture
async def fresh_nats(fresh_server: EmbeddedNats) -> str:
    """Its URL for exo's own processes (user `exo`)."""
    return fresh_server.url


# An `exo` process whose downloads come from the module's `hub` fixture (a fake Hub); modules
# that start theirs otherwise define their own `node`.
@pytest.fixture(scope="module")
def node(tmp_path_factory, hub):
    exo = start_exo(tmp_path_factory.mktemp("node"), hub)
    yield exo
    exo.interrupt()


# Clients of the module's `node` fixture (an `exo` process), for the end-to-end API tests.
@pytest.fixture(scope="module")
def http(node):
    with httpx.Client(base_url=node.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(node) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def claude(node) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=node.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llama(node) -> ollama.Client:
    return ollama.Client(host=node.url, timeout=120)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest files first (tests/file_durations.json), each file's tests in their own order: with
    pytest-xdist's per-file scheduling the two workers then finish close together."""
    from tests.support.file_durations import load

    seconds = load()
    position = {id(item): n for n, item in enumerate(items)}
    items.sort(key=lambda item: (-seconds.get(item.nodeid.split("::")[0], 0.0), position[id(item)]))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent with `-p no:xdist`
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from tests.support.scheduling import ClusterTestsInOneQueue

    return ClusterTestsInOneQueue(config, log)
