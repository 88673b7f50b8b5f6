"""`exo keys` as an admin runs it at a terminal (a separate process), against the API and a master
running in this process over a nats-server of its own: create prints the secret once and asks for
what its flags say, list shows keys without secrets, delete removes one, usage reads the log's
counts, and each refusal (no key, a wrong key, a user's key, nobody listening) names the URL."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer

from exo.api.app import build_app
from exo.api.context import ApiContext
from exo.api.outcomes import CommandOutcomes
from exo.bus.catch_up import catch_up
from exo.bus.connection import connect
from exo.bus.event_log import EventLog
from exo.bus.provision import provision
from exo.bus.server.embedded import EmbeddedNats
from exo.bus.state_view import StateView
from exo.core.events import TaskCreated, TaskFinished
from exo.core.ids import CommandId, InstanceId, ModelId, NodeId, TaskId
from exo.core.keys import KeyLimits
from exo.core.requests import GenerationParams, TranscribeInputs
from exo.core.types import Task
from exo.master.service import Master
from exo.settings.services import ApiSettings
from tests.support.exo_process import exo_command, free_port
from tests.support.exo_tools import in_thread

pytestmark = pytest.mark.slow  # starts `exo keys` processes

ADMIN = "admin-key-for-the-cli"
DAY_ONE = 1_767_225_600.0  # 2026-01-01T00:00:00Z


class Api:
    def __init__(self, url: str, view: StateView, log: EventLog) -> None:
        self.url, self.view, self.log = url, view, log


@pytest_asyncio.fixture(scope="module")
async def api(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Api]:
    """The key routes of a node with the admin key ADMIN, and the master that decides them."""
    server = EmbeddedNats(tmp_path_factory.mktemp("keys-cli") / "nats", port=0)
    await server.start()
    nc = await connect([server.url], "exo-test")
    await provision(nc)
    view, _ = await catch_up(nc)
    master = asyncio.create_task(Master(nc, view, {}, node_id=NodeId("node-a")).run())
    ctx = ApiContext(nc, view, CommandOutcomes(nc, view), {}, NodeId("node-a"), tmp_path_factory.mktemp("data"),
                     settings=ApiSettings(api_keys=(ADMIN,)))
    http = TestServer(build_app(ctx))
    await http.start_server()
    yield Api(str(http.make_url("")).rstrip("/"), view, EventLog(nc))
    await http.close()
    master.cancel()
    await asyncio.wait({master}, timeout=10)
    await view.stop()
    await nc.close()
    server.stop()


def keys(*args: str, key: str | None = ADMIN) -> subprocess.CompletedProcess[str]:
    """`exo keys ARGS`, with the admin key in EXO_API_KEY (None: no key at all)."""
    env = {k: v for k, v in os.environ.items() if k not in ("EXO_API_KEY", "EXO_API_PORT")}
    if key is not None:
        env["EXO_API_KEY"] = key
    return subprocess.run([*exo_command(), "keys", *args], capture_output=True, text=True, timeout=120, env=env)


async def created(api: Api, *flags: str) -> tuple[str, str]:
    """A key made with `exo keys create --json FLAGS`: its id and secret."""
    done = await in_thread(keys, "create", "--url", api.url, "--json", *flags)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    return answer["key"]["key_id"], answer["secret"]


async def test_create_prints_the_secret_once_and_asks_for_what_its_flags_say(api: Api):
    done = await in_thread(keys, "create", "--url", api.url, "--name", "lab-agent", "--models", "org/*", "x/y",
                           "--priority", "batch", "--requests-per-minute", "3", "--tokens-per-day", "1000",
                           "--cache-scope", "team")
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    key_id = first.removeprefix("created key ").removesuffix(" (lab-agent)")
    secret = second.removeprefix("secret (shown this once; the node keeps only its hash): ")
    assert secret.startswith("exo-") and secret != second
    key = api.view.state.api_keys[key_id]
    assert (key.name, key.models, key.priority, key.cache_scope, key.admin) == ("lab-agent", ["org/*", "x/y"], "batch",
                                                                                  "team", False)
    assert key.limits == KeyLimits(requests_per_minute=3, tokens_per_day=1000)
    assert key.secret_sha256 == hashlib.sha256(secret.encode()).hexdigest()  # the secret printed is the key's


async def test_list_shows_every_key_and_never_a_secret(api: Api):
    key_id, secret = await created(api, "--name", "listed", "--admin", "--concurrent-requests", "2")
    as_json = await in_thread(keys, "list", "--url", api.url, "--json")
    assert as_json.returncode == 0, as_json.stderr
    entry = {k["key_id"]: k for k in json.loads(as_json.stdout)}[key_id]
    assert (entry["name"], entry["admin"], entry["limits"]["concurrent_requests"]) == ("listed", True, 2)
    assert "secret_sha256" not in entry and secret not in as_json.stdout
    text = await in_thread(keys, "list", "--url", api.url)
    assert text.returncode == 0, text.stderr
    header, *rows = text.stdout.splitlines()
    assert header.split() == ["id", "name", "admin", "models", "limits", "priority", "created", "(UTC)"]
    (row,) = [r for r in rows if r.split()[0] == key_id]
    assert row.split()[1:6] == ["listed", "yes", "all", "concurrent_requests=2", "interactive"]
    assert secret not in text.stdout


async def test_delete_removes_the_key_and_an_unknown_id_is_the_apis_404(api: Api):
    key_id, _ = await created(api, "--name", "short-lived")
    done = await in_thread(keys, "delete", key_id, "--url", api.url)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"deleted key {key_id}\n", "")
    assert key_id not in api.view.state.api_keys
    again = await in_thread(keys, "delete", key_id, "--url", api.url)
    assert (again.returncode, again.stderr) == (
        2, f"exo keys: DELETE {api.url}/keys/{key_id}: 404 unknown API key {key_id!r}\n")


async def test_usage_reads_one_keys_counts_or_every_keys(api: Api):
    first, _ = await created(api, "--name", "counted")
    second, _ = await created(api, "--name", "also-counted")
    speech = GenerationParams(transcribe=TranscribeInputs(audio="a" * 64, seconds=2.5))
    # One finished task each, as the master and a worker log them: a transcription, then a chat.
    for key_id, tokens, params in ((first, 7, speech), (second, 11, GenerationParams())):
        task = Task(task_id=TaskId(f"t-{key_id}"), instance_id=InstanceId("i"), model_id=ModelId("org/m"),
                    key_id=key_id, created_at=DAY_ONE, params=params)
        await api.log.append(TaskCreated(command_id=CommandId(task.task_id), term=api.view.state.leader_term,
                                         task=task), f"created-{key_id}")
        seq = await api.log.append(TaskFinished(task_id=task.task_id, status="completed", prompt_tokens=5,
                                                completion_tokens=tokens), f"finished-{key_id}")
    await api.view.wait_for(seq)
    one = await in_thread(keys, "usage", first, "--url", api.url, "--json")
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout) == [{"key_id": first, "day": "2026-01-01", "model": "org/m", "requests": 1,
                                       "prompt_tokens": 5, "completion_tokens": 7, "cached_tokens": 0,
                                       "audio_seconds": 2.5}]
    every = await in_thread(keys, "usage", "--url", api.url)
    assert every.returncode == 0, every.stderr
    rows = [line.split() for line in every.stdout.splitlines()[1:]]
    assert [first, "2026-01-01", "org/m", "1", "5", "7", "0", "2.5"] in rows
    assert [second, "2026-01-01", "org/m", "1", "5", "11", "0", "0.0"] in rows


async def test_each_refusal_names_the_url_and_what_to_do(api: Api):
    _, user_secret = await created(api, "--name", "a-user")
    without = await in_thread(keys, "list", "--url", api.url, key=None)
    assert (without.returncode, without.stderr) == (
        2, f"exo keys: {api.url} needs an admin key: pass --key or set EXO_API_KEY "
           "(a valid API key is required: send 'Authorization: Bearer <key>')\n")
    wrong = await in_thread(keys, "list", "--url", api.url, "--key", "not-a-key", key=None)
    assert (wrong.returncode, wrong.stderr) == (
        2, f"exo keys: {api.url} does not accept this key (a valid API key is required: send "
           "'Authorization: Bearer <key>')\n")
    user = await in_thread(keys, "create", "--name", "x", "--url", api.url, key=user_secret)
    assert user.returncode == 2
    assert user.stderr.startswith(f"exo keys: {api.url}: this key is not an admin key (API key key_")
    nobody = f"http://127.0.0.1:{free_port()}"
    closed = await in_thread(keys, "usage", "--url", nobody)
    assert (closed.returncode, closed.stderr) == (
        2, f"exo keys: cannot reach the API at {nobody}: [Errno 111] Connection refused; is a node running there? "
           "(--url, or EXO_API_PORT)\n")
    assert "x" not in {k.name for k in api.view.state.api_keys.values()}  # the user's create made nothing
