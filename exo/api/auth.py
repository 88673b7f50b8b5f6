"""API keys: with keys set (EXO_API_KEYS on this node, or keys added with POST /keys), every route
but /health, /livez and the dashboard's page and static files needs `Authorization: Bearer <key>`
(Anthropic clients send `x-api-key`, accepted on /v1/messages). A wrong or missing key gets 401
in the surface's own error shape (see errors.py).

EXO_API_KEYS are admin keys. Keys in State (exo/core/keys.py) are looked up by the sha256 of
what is presented; an admin one may do everything, any other only inference (the routes in
INFERENCE_ROUTES) on the models its patterns allow, within its limits (the master enforces
those), and read or cancel its own generations only. The grant of the request is in
`current_grant` for the handlers below."""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from contextvars import ContextVar
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Handler

from exo.api.context import context_of
from exo.api.errors import ApiError
from exo.core.keys import ApiKey
from exo.core.types import Task

log = logging.getLogger(__name__)

# /cluster/join: a new node has no API key; its join token is the credential (exo/api/cluster/join_tokens.py).
OPEN_PATHS = frozenset({"/health", "/livez", "/", "/cluster/join"})
# The dashboard's static files hold no cluster data; a browser cannot send a Bearer header when
# it loads a page, so the page is public and asks for the key itself for its data requests.
OPEN_PREFIXES = ("/dashboard/",)
# What a key without admin may call: the inference surfaces, the model lists, its own usage.
INFERENCE_ROUTES = re.compile(
    r"(POST /v1/(chat/completions|completions|responses|embeddings|rerank|messages(/count_tokens)?|cancel/[^/]+))"
    r"|(POST /(tokenize|detokenize|rerank|v2/rerank))|(POST /v1/audio/(transcriptions|translations|speech))"
    r"|(GET /v1/chat/completions/[^/]+/stream)|(GET /(v1/models(/.+)?|models|usage))"
    r"|(POST /api/(chat|generate|embed|embeddings|show))|(GET /api/(tags|ps|version))")


@dataclass(frozen=True)
class Grant:
    """Who a request is: an admin (EXO_API_KEYS, an admin key, or a node without keys) or a key."""

    admin: bool
    key: ApiKey | None = None

    def may_use(self, model_id: str) -> bool:
        return self.key is None or self.key.may_use(model_id)

    def owns(self, task: Task) -> bool:
        """Whether this caller may cancel the task: its key asked for it, or it is an admin. Another
        key's generation is answered as unknown, so its ids and text stay that key's."""
        return self.admin or (self.key is not None and task.key_id == self.key.key_id)

    def may_read(self, task: Task) -> bool:
        """Whether this caller may resume the task's stream: it owns it and may use its model."""
        return self.owns(task) and self.may_use(task.model_id)


OPEN = Grant(admin=True)
current_grant: ContextVar[Grant] = ContextVar("current_grant", default=OPEN)


def is_open_path(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    ctx = context_of(request)
    grant = OPEN
    if not is_open_path(request.path) and (ctx.settings.api_keys or ctx.view.state.api_keys):
        grant = _grant_of(_presented_key(request), ctx.settings.api_keys, ctx.view.state.api_keys)
        if not grant.admin and not INFERENCE_ROUTES.fullmatch(f"{request.method} {request.path}"):
            raise ApiError(403, f"API key {grant.key.key_id if grant.key else ''} may use the inference routes only; "
                                f"{request.method} {request.path} needs an admin key", code="permission_denied")
    request["grant"] = grant
    token = current_grant.set(grant)
    try:
        return await handler(request)
    finally:
        current_grant.reset(token)


def _grant_of(presented: str, env_keys: tuple[str, ...], state_keys: dict[str, ApiKey]) -> Grant:
    if presented and _key_matches(presented, env_keys):
        return OPEN
    # Looked up by the hash of what was presented: the time it takes says nothing about the secrets.
    key = _by_hash(state_keys).get(hashlib.sha256(presented.encode()).hexdigest())
    if not presented or key is None:
        raise ApiError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return Grant(admin=key.admin, key=key)


_index: tuple[dict[str, ApiKey], dict[str, ApiKey]] = ({}, {})


def _by_hash(keys: dict[str, ApiKey]) -> dict[str, ApiKey]:
    """The keys by their secret's hash, made again only when State's key dict is another one
    (the reducer replaces it on a key's event): not a scan of every key on every request."""
    global _index
    if _index[0] is not keys:
        _index = (keys, {k.secret_sha256: k for k in keys.values()})
    return _index[1]


def _presented_key(request: web.Request) -> str:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    if request.path.startswith("/v1/messages"):
        return request.headers.get("x-api-key", "")
    return ""


def _key_matches(presented: str, keys: tuple[str, ...]) -> bool:
    # Compare against every key in constant time: how long it takes says nothing about the keys.
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented.encode(), key.encode())
    return matched and bool(presented)
