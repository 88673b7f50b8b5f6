"""Join tokens over HTTP (exo/core/join_tokens.py; docs/deploy.md, "Joining with a token").

    POST /cluster/join_tokens  (admin)  {"ttl_s"?: 3600, "uses"?: 1, "api_url"?}  -> {"token", ...}
    GET  /cluster/join_tokens  (admin)  the tokens State keeps: ids, expiry, uses left, who used them
    POST /cluster/join         (no key: the token is the credential)  {"token", "node_name"?}
                               -> {"cluster_secret", "join"}: what `exo join` starts with

A token is made only on a member of a discovered cluster that has a secret (trusted-LAN clusters
take any node that hears them; a node given --nats joins no cluster). A use is checked here first
(a wrong or spent token costs the master nothing) and decided by the master (one use at a time).
Every refusal is a 403 naming why, the same for an unknown id and a wrong secret.
"""

from __future__ import annotations

import secrets
import time
from urllib.parse import urlsplit

import msgspec
from aiohttp import web

from exo.api.auth import current_grant
from exo.api.cluster.token_string import BadToken, TokenParts, decode_token, encode_token
from exo.api.context import context_of
from exo.api.errors import ApiError
from exo.api.outcomes import new_command_id
from exo.api.request_body import decode_body
from exo.core.commands import CreateJoinToken, RedeemJoinToken
from exo.core.join_tokens import MAX_TTL_S, MAX_USES, MIN_TTL_S, describe, redeem_problem, secret_digest
from exo.core.node_names import node_display

DEFAULT_TTL_S = 3600.0


class CreateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    ttl_s: float = DEFAULT_TTL_S
    uses: int = 1
    api_url: str = ""  # where new nodes reach this API ("": this node's cluster address, the port asked on)


class JoinRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    token: str
    node_name: str = ""


async def create_token(request: web.Request) -> web.Response:
    ctx = context_of(request)
    asked = await decode_body(request, CreateRequest) if request.can_read_body else CreateRequest()
    if not MIN_TTL_S <= asked.ttl_s <= MAX_TTL_S:
        raise ApiError(400, f"ttl_s must be between {MIN_TTL_S:g} and {MAX_TTL_S:g} seconds", param="ttl_s")
    if not 1 <= asked.uses <= MAX_USES:
        raise ApiError(400, f"uses must be between 1 and {MAX_USES}", param="uses")
    secret, join_address = _cluster_access(request)
    api_url = asked.api_url or _api_url(request, join_address)
    if not api_url.startswith(("http://", "https://")) or len(api_url) > 200:
        raise ApiError(400, "api_url must be an http:// or https:// URL new nodes can reach", param="api_url")
    token_id, token_secret = secrets.token_hex(8), secrets.token_urlsafe(32)
    grant = current_grant.get()
    created_by = (f"API key {grant.key.key_id}" if grant.key is not None else "an admin") + \
        f" via the API of node {node_display(ctx.view.state, ctx.node_id)}"
    now = time.time()
    await ctx.outcomes.call(CreateJoinToken(command_id=new_command_id(), token_id=token_id,
                                            secret_sha256=secret_digest(token_secret), ttl_s=asked.ttl_s,
                                            uses=asked.uses, created_by=created_by, at=now))
    token = encode_token(TokenParts(api=api_url.rstrip("/"), id=token_id, secret=token_secret))
    return web.json_response({"token": token, "token_id": token_id, "expires_at": now + asked.ttl_s,
                              "uses": asked.uses, "api_url": api_url})


async def list_tokens(request: web.Request) -> web.Response:
    tokens = context_of(request).view.state.join_tokens
    return web.json_response({"data": [describe(token) for token in tokens.values()]})


async def join(request: web.Request) -> web.Response:
    """A new node's use of a token: the cluster's secret and a member's cluster address."""
    ctx = context_of(request)
    asked = await decode_body(request, JoinRequest)
    secret, join_address = _cluster_access(request)
    try:
        parts = decode_token(asked.token)
    except BadToken as bad:
        raise ApiError(400, str(bad), param="token") from None
    digest, now = secret_digest(parts.secret), time.time()
    if (problem := redeem_problem(ctx.view.state.join_tokens, parts.id, digest, now)) is not None:
        raise ApiError(403, problem, param="token", code="invalid_join_token")
    await ctx.outcomes.call(RedeemJoinToken(command_id=new_command_id(), token_id=parts.id, secret_sha256=digest,
                                            node_name=asked.node_name[:100], at=now))
    return web.json_response({"cluster_secret": secret, "join": join_address})


def _cluster_access(request: web.Request) -> tuple[str, str]:
    access = context_of(request).cluster_join()
    if access is None:
        raise ApiError(409, "this node is not a member of a cluster with a secret: join tokens are for a discovered "
                            "cluster given EXO_CLUSTER_SECRET (a trusted-LAN cluster takes any node that hears it; "
                            "with --nats, nodes log in to the NATS you run)", code="conflict")
    return access


def _api_url(request: web.Request, join_address: str) -> str:
    """This API as another machine reaches it: the cluster's address, on the port the admin used."""
    host = join_address.rpartition(":")[0]
    port = urlsplit(str(request.url)).port or (443 if request.secure else 80)
    return f"{'https' if request.secure else 'http'}://{host}:{port}"
