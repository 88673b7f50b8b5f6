"""API keys managed at runtime (admin only): POST /keys (the secret is in this answer and never
again: State keeps its sha256), GET /keys, GET / PATCH / DELETE /keys/{id}; and GET /usage, every
key's for an admin, a key's own for it, with `caller` (admin or not, and the caller's own key).
A deleted key fails on every API node as soon as that node folds the event (milliseconds;
tests/test_keys.py asserts within a second)."""

from __future__ import annotations

import hashlib
import secrets
import time
from typing import Any

import msgspec
from aiohttp import web

from exo.api.auth import current_grant
from exo.api.context import context_of
from exo.api.errors import ApiError
from exo.api.outcomes import new_command_id
from exo.api.request_body import decode_body
from exo.core.commands import DeleteKey, SetKey
from exo.core.keys import ApiKey, KeyLimits, Tier
from exo.core.state import State


class KeyRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /keys and PATCH /keys/{id}: a field left out keeps its value (its default on POST)."""

    name: str | msgspec.UnsetType = msgspec.UNSET
    admin: bool | msgspec.UnsetType = msgspec.UNSET
    models: list[str] | msgspec.UnsetType = msgspec.UNSET
    limits: KeyLimits | msgspec.UnsetType = msgspec.UNSET
    priority: Tier | msgspec.UnsetType = msgspec.UNSET
    cache_scope: str | msgspec.UnsetType = msgspec.UNSET  # keys that share one reuse each other's prompt cache


def key_entry(key: ApiKey) -> dict[str, Any]:
    fields: dict[str, Any] = msgspec.to_builtins(key)
    del fields["secret_sha256"]
    return fields


async def add_key(request: web.Request) -> web.Response:
    asked = await decode_body(request, KeyRequest)
    ctx = context_of(request)
    secret = f"exo-{secrets.token_urlsafe(32)}"
    key = _changed(ApiKey(key_id=f"key_{secrets.token_hex(8)}", secret_sha256=hashlib.sha256(secret.encode()).hexdigest(),
                          created_at=time.time()), asked)
    await ctx.outcomes.call(SetKey(command_id=new_command_id(), key=key, new=True))
    return web.json_response({"message": "key added: its secret is shown once, here", "secret": secret,
                              "key": key_entry(key)})


async def list_keys(request: web.Request) -> web.Response:
    keys = context_of(request).view.state.api_keys
    return web.json_response({"object": "list", "data": [key_entry(k) for _, k in sorted(keys.items())]})


async def get_key(request: web.Request) -> web.Response:
    return web.json_response(key_entry(_known(context_of(request).view.state, request.match_info["key_id"])))


async def update_key(request: web.Request) -> web.Response:
    asked = await decode_body(request, KeyRequest)
    ctx = context_of(request)
    key = _changed(_known(ctx.view.state, request.match_info["key_id"]), asked)
    await ctx.outcomes.call(SetKey(command_id=new_command_id(), key=key, new=False))
    return web.json_response({"message": "key changed", "key": key_entry(key)})


async def delete_key(request: web.Request) -> web.Response:
    key_id = request.match_info["key_id"]
    await context_of(request).outcomes.call(DeleteKey(command_id=new_command_id(), key_id=key_id))
    return web.json_response({"message": "key deleted", "key_id": key_id})


def _known(state: State, key_id: str) -> ApiKey:
    key = state.api_keys.get(key_id)
    if key is None:
        raise ApiError(404, f"unknown API key {key_id!r} (GET /keys lists them)", param="key_id")
    return key


def _changed(key: ApiKey, asked: KeyRequest) -> ApiKey:
    changes = {name: value for name in KeyRequest.__struct_fields__
               if (value := getattr(asked, name)) is not msgspec.UNSET}
    changed = msgspec.structs.replace(key, **changes)
    if problem := changed.problem():
        raise ApiError(400, f"invalid key: {problem}", param=problem.split(" ", 1)[0])
    return changed


async def usage(request: web.Request) -> web.Response:
    """Requests, tokens and audio seconds by key, UTC day and model: every key's for an admin, else the key's own."""
    state = context_of(request).view.state
    grant = current_grant.get()
    asked = request.query.get("key_id")
    if not grant.admin:
        own = grant.key.key_id if grant.key else ""
        if asked and asked != own:
            raise ApiError(403, "a key may read its own usage only", param="key_id", code="permission_denied")
        asked = own
    rows = [{"key_id": key_id, "day": day, "model": model, **msgspec.to_builtins(counts)}
            for key_id, days in sorted(state.usage.items()) if not asked or key_id == asked
            for day, models in sorted(days.items()) for model, counts in sorted(models.items())]
    # Who asks: the dashboard learns from this one answer whether to show the admin panels, and a
    # key's page shows its own limits (GET /keys/{id} is an admin's).
    caller = {"admin": grant.admin, "key": key_entry(grant.key) if grant.key else None}
    return web.json_response({"object": "list", "data": rows, "caller": caller})
