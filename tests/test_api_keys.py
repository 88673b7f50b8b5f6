"""API keys and body limits, against `exo` as a process started with EXO_API_KEYS: every route
but /health refuses a request without a valid key, in its surface's own error shape."""

from __future__ import annotations

import re
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from exo.api.app import build_app
from exo.api.auth import is_open_path
from exo.api.context import ApiContext
from tests.support.e2e import start_exo
from tests.support.fake_hub import FakeHub

pytestmark = pytest.mark.slow

KEYS = ("first-key", "second-key")
MAX_BODY = 64 * 1024


def every_route() -> list[tuple[str, str]]:
    """(method, path) of every route the app registers, placeholders filled in."""
    app = build_app(ApiContext(nc=None, view=None, outcomes=None, builtin_cards={}, node_id="", data_dir=Path(".")))  # type: ignore[arg-type]
    routes = []
    for route in app.router.routes():
        if route.method == "HEAD":
            continue
        path = re.sub(r"\{[^}]+\}", "x", route.resource.canonical)
        routes.append((route.method, path))
    return routes


ROUTES = every_route()


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with FakeHub({}) as hub:
        env = {"EXO_API_KEYS": ",".join(KEYS), "EXO_MAX_BODY_BYTES": str(MAX_BODY)}
        exo = start_exo(tmp_path_factory.mktemp("node"), hub, env)
        yield exo
        exo.interrupt()


@pytest.fixture(scope="module")
def http(node):
    with httpx.Client(base_url=node.url, timeout=30) as client:
        yield client


def status_of(http: httpx.Client, method: str, path: str, headers: dict[str, str]) -> tuple[int, object]:
    with http.stream(method, path, headers=headers, json={} if method == "POST" else None) as response:
        if response.headers.get("Content-Type", "").startswith("text/event-stream"):
            return response.status_code, None  # an open stream: its status is the answer
        response.read()
        is_json = response.headers.get("Content-Type", "").startswith("application/json")
        return response.status_code, response.json() if is_json else None


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_every_route_but_health_needs_a_key(http, method, path):
    status, body = status_of(http, method, path, {})
    if path in ("/health", "/livez"):
        assert status == 200
        return
    if path == "/cluster/join":  # a new node has no key: its join token is the credential, and {} has none
        assert status == 400 and body["error"]["param"] == "token", body
        return
    if is_open_path(path):  # the dashboard's page and static files hold no data
        assert status == (200 if path == "/" else 404)  # /dashboard/x is no such file
        return
    assert status == 401, (method, path, body)
    if path.startswith("/api/"):
        assert isinstance(body["error"], str)  # Ollama's shape
    elif path.startswith("/v1/messages"):  # /v1/messages/count_tokens too
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    else:
        assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == "invalid_api_key"
    assert status_of(http, method, path, {"Authorization": "Bearer wrong"})[0] == 401
    for key in KEYS:
        assert status_of(http, method, path, {"Authorization": f"Bearer {key}"})[0] != 401


def test_the_route_list_covers_every_surface():
    paths = {p for _, p in ROUTES}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/api/chat", "/metrics",
            "/events", "/v1/cancel/x", "/health", "/livez"} <= paths


# What a key without admin may call (docs/deploy.md, "Scopes"), as the app spells its routes. A new
# route is refused to such keys unless it is added here: a decision, not a default.
INFERENCE = {("POST", "/v1/chat/completions"), ("GET", "/v1/chat/completions/x/stream"), ("POST", "/v1/completions"),
             ("POST", "/v1/responses"), ("POST", "/v1/embeddings"), ("POST", "/v1/messages"), ("POST", "/v1/cancel/x"),
             ("GET", "/v1/models"), ("GET", "/v1/models/x"), ("GET", "/models"), ("GET", "/usage"),
             ("POST", "/api/chat"), ("POST", "/api/generate"), ("POST", "/api/embed"), ("POST", "/api/embeddings"),
             ("POST", "/api/show"), ("GET", "/api/tags"), ("GET", "/api/ps"), ("GET", "/api/version"),
             ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/messages/count_tokens"),
             ("POST", "/v1/rerank"), ("POST", "/rerank"), ("POST", "/v2/rerank"),
             ("POST", "/v1/audio/transcriptions"), ("POST", "/v1/audio/translations"), ("POST", "/v1/audio/speech")}
# The probes, and the dashboard's page and files: they hold no data. A join token's use: the token is the credential.
PUBLIC = {("GET", "/health"), ("GET", "/livez"), ("GET", "/"), ("GET", "/dashboard/x"),
          ("GET", "/dashboard/vendor/x"), ("POST", "/cluster/join")}


def test_a_key_without_admin_gets_403_on_every_route_but_inference(http):
    added = http.post("/keys", json={"name": "inference-only"}, headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert added.status_code == 200, added.text
    headers = {"Authorization": f"Bearer {added.json()['secret']}"}
    assert set(ROUTES) >= INFERENCE | PUBLIC  # the lists name routes that exist
    answers = {(method, path): status_of(http, method, path, headers) for method, path in ROUTES}
    refused = {route for route, (status, _) in answers.items() if status == 403}
    assert refused == set(ROUTES) - INFERENCE - PUBLIC, answers
    for route in refused:
        assert "needs an admin key" in str(answers[route][1]), (route, answers[route])
    assert not {route for route in INFERENCE | PUBLIC if answers[route][0] == 401}, answers


def test_anthropic_clients_may_send_x_api_key_on_messages_only(http, node):
    claude = anthropic.Anthropic(base_url=node.url, api_key=KEYS[0], max_retries=0)
    with pytest.raises(anthropic.NotFoundError):  # past the key check, to the unknown model
        claude.messages.create(model="nobody/nothing", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=node.url, api_key="wrong", max_retries=0).messages.create(
            model="nobody/nothing", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert http.get("/state", headers={"x-api-key": KEYS[0]}).status_code == 401


def test_openai_clients_send_their_key_as_a_bearer_token(node):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{node.url}/v1", api_key="wrong", max_retries=0).models.list()
    models = openai.OpenAI(base_url=f"{node.url}/v1", api_key=KEYS[1], max_retries=0).models.list()
    assert "mlx-community/Llama-3.2-1B-Instruct-4bit" in [m.id for m in models.data]


def test_a_body_over_the_limit_gets_413_in_the_surface_shape(http):
    headers = {"Authorization": f"Bearer {KEYS[0]}", "Content-Type": "application/json"}
    big = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * MAX_BODY + b'"}]}'
    response = http.post("/v1/chat/completions", content=big, headers=headers)
    assert response.status_code == 413 and response.json()["error"]["message"]
    ollama_shaped = http.post("/api/chat", content=big, headers=headers)
    assert ollama_shaped.status_code == 413 and isinstance(ollama_shaped.json()["error"], str)
    assert http.get("/health").status_code == 200
