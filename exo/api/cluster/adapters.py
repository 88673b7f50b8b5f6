"""LoRA adapters: added (POST /adapters, from the Hub or uploaded), listed (GET /adapters, and
each as "<base>:<adapter>" in GET /v1/models), deleted (DELETE /adapters/{name}, which waits for the
requests that use it: exo/master/adapters.py).

An adapter's weights go to the object store exo-adapters under their sha256 before the master
is asked to add it; the master checks that it fits its base model (exo/core/adapters.py) and a
refusal removes the weights again unless another adapter shares them. Requests use it as
`"model": "<base>:<adapter>"` once an instance of that id is placed (POST /place_instance).

    curl -F name=pirate -F base_model=org/model -F config=@adapter_config.json \\
         -F weights=@adapters.safetensors http://localhost:52415/adapters
    curl -d '{"name": "pirate", "base_model": "org/model", "hub_id": "org/pirate-lora"}' .../adapters
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import msgspec
from aiohttp import BodyPartReader, web
from msgspec.structs import replace

from exo.api.card_source import HUB_STATUS
from exo.api.context import ApiContext, context_of
from exo.api.errors import ApiError
from exo.api.outcomes import new_command_id
from exo.api.request_body import decode_body
from exo.bus.adapters import delete_adapter, store_adapter
from exo.bus.blobs import BlobStoreFull, digest_of
from exo.core.adapter_use import open_requests_of, weights_shared
from exo.core.adapters import Adapter, is_valid_adapter_name, read_adapter
from exo.core.commands import AddAdapter, DeleteAdapter
from exo.core.events import AdapterAdded, AdapterDeleting
from exo.core.ids import ModelId
from exo.core.state import State
from exo.core.types import is_valid_model_id
from exo.models.adapter_source import MAX_CONFIG_BYTES, AdapterTooLarge, hub_adapter
from exo.models.transfer import DownloadError

MAX_FORM_PARTS = 8
# After a 202, how long the API node still follows a deletion to remove the weights once it is done.
FOLLOW_DELETION_S = 24 * 3600.0
# DELETE /adapters/{name}: how long it waits for the requests using the adapter to end (`wait`).
DELETE_WAIT_DEFAULT_S = 600.0
DELETE_WAIT_MAX_S = 3600.0


class AdapterFromHub(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    base_model: ModelId
    hub_id: str
    revision: str = "main"


def adapter_entry(adapter: Adapter, state: State) -> dict[str, Any]:
    return {"name": adapter.name, "model": adapter.model_id, "base_model": adapter.base_model,
            "digest": adapter.digest, "size": adapter.size, "fine_tune_type": adapter.fine_tune_type,
            "rank": adapter.rank, "layers": adapter.layers, "source": adapter.source,
            "instances": [i.instance_id for i in state.instances_of(adapter.model_id)],
            "deleting": adapter.deleting, "requests": open_requests_of(state, adapter.model_id)}


async def add_adapter(request: web.Request) -> web.Response:
    ctx = context_of(request)
    if request.content_type.startswith("multipart/"):
        fields, config, weights = await _upload(request, ctx.settings.max_adapter_bytes)
        name, base, source = fields.get("name", ""), ModelId(fields.get("base_model", "")), "upload"
        _check_names(ctx, name, base)
    else:
        asked = await decode_body(request, AdapterFromHub)
        name, base, source = asked.name, asked.base_model, f"{asked.hub_id}@{asked.revision}"
        _check_names(ctx, name, base)
        config, weights = await _from_hub(asked, ctx.settings.max_adapter_bytes)
    facts = read_adapter(config, weights, ctx.card(base))
    if isinstance(facts, str):
        raise ApiError(400, f"not an mlx-lm LoRA adapter: {facts}", param="config" if "config" in facts else "weights")
    adapter = Adapter(name=name, base_model=base, digest=digest_of(weights), size=len(weights),
                      config=config.decode(), fine_tune_type=facts.fine_tune_type, rank=facts.rank, layers=facts.layers,
                      hidden_inputs=facts.hidden_inputs, source=source)
    try:
        _, uploaded = await store_adapter(ctx.nc, weights, adapter.digest)
    except BlobStoreFull as full:
        raise ApiError(507, str(full), code="insufficient_storage") from None
    try:
        event = await ctx.outcomes.call(AddAdapter(command_id=new_command_id(), adapter=adapter))
    except ApiError:
        if uploaded and not weights_shared(ctx.view.state, replace(adapter, name="")):
            await delete_adapter(ctx.nc, adapter.digest)  # refused: nothing refers to the weights
        raise
    assert isinstance(event, AdapterAdded)
    if not uploaded:  # the weights were in the store already, unnamed: the master's sweep may have just taken them
        await store_adapter(ctx.nc, weights, adapter.digest)  # one look when they are still there
    return web.json_response({"message": "adapter added", "adapter": adapter_entry(event.adapter, ctx.view.state)})


def _check_names(ctx: ApiContext, name: str, base: ModelId) -> None:
    if not is_valid_adapter_name(name):
        raise ApiError(400, f"name must be letters, digits, '.', '_' and '-' (at most 64), not {name!r}: requests "
                            "then ask for \"<base model>:<name>\"", param="name")
    card = ctx.card(base)
    if card is None or card.model_id != base:
        raise ctx.unknown_model(base, "base_model", f"unknown base model {base!r}")


async def _upload(request: web.Request, max_bytes: int) -> tuple[dict[str, str], bytes, bytes]:
    """The form's text fields and its two files, each read within its bound, never whole first."""
    fields: dict[str, str] = {}
    files: dict[str, bytes] = {}
    reader = await request.multipart()
    while (part := await reader.next()) is not None:
        if len(fields) + len(files) >= MAX_FORM_PARTS:
            raise ApiError(400, f"the form has more than {MAX_FORM_PARTS} parts; send name, base_model, config and weights")
        if not isinstance(part, BodyPartReader) or part.name is None:
            raise ApiError(400, "the form may not nest multipart parts; send name, base_model, config and weights")
        limit = {"config": MAX_CONFIG_BYTES, "weights": max_bytes}.get(part.name, 1024)
        data = await _read_part(part, limit)
        if part.name in ("config", "weights"):
            files[part.name] = data
        else:
            fields[part.name] = data.decode(errors="replace")
    missing = [name for name in ("config", "weights") if name not in files]
    if missing:
        raise ApiError(400, f"the form has no {' or '.join(missing)} file: send config=@adapter_config.json and "
                            "weights=@adapters.safetensors", param=missing[0])
    return fields, files["config"], files["weights"]


async def _read_part(part: BodyPartReader, limit: int) -> bytes:
    chunks, size = [], 0
    while chunk := await part.read_chunk(1 << 20):
        size += len(chunk)
        if size > limit:
            setting = " (EXO_MAX_ADAPTER_BYTES)" if part.name == "weights" else ""
            raise ApiError(413, f"the form's {part.name!r} is over {limit} bytes{setting}", param=part.name)
        chunks.append(chunk)
    return b"".join(chunks)


async def _from_hub(asked: AdapterFromHub, max_bytes: int) -> tuple[bytes, bytes]:
    if not is_valid_model_id(asked.hub_id) or "/" not in asked.hub_id:  # checked here, not by the Hub's 502
        raise ApiError(400, f"hub_id must be a Hub repository id such as 'org/name-lora', not {asked.hub_id!r}",
                       param="hub_id")
    if not 0 < len(asked.revision) <= 200:
        raise ApiError(400, "revision must be a branch, tag or commit of at most 200 characters", param="revision")
    try:
        found = await asyncio.to_thread(hub_adapter, asked.hub_id, asked.revision, max_bytes)
    except AdapterTooLarge as error:
        raise ApiError(413, str(error), param="hub_id") from None
    except DownloadError as error:
        raise ApiError(HUB_STATUS.get(error.code, 502), error.reason, param="hub_id", code=error.code) from None
    return found.config, found.weights


async def list_adapters(request: web.Request) -> web.Response:
    state = context_of(request).view.state
    data = [adapter_entry(a, state) for _, a in sorted(state.adapters.items())]
    return web.json_response({"object": "list", "data": data})


async def get_adapter(request: web.Request) -> web.Response:
    state = context_of(request).view.state
    adapter = state.adapters.get(request.match_info["name"])
    if adapter is None:
        raise ApiError(404, f"unknown adapter {request.match_info['name']!r} (GET /adapters lists them)", param="name")
    return web.json_response(adapter_entry(adapter, state))


async def delete_adapter_route(request: web.Request) -> web.Response:
    """Deleted at once when no request uses it. Else the master marks it (new requests for it are a
    404) and deletes it when the last one ends: this waits up to `wait` seconds for that (200), then
    answers 202 with how many still run; the deletion goes on without the caller."""
    ctx = context_of(request)
    name, wait_s = request.match_info["name"], _wait_seconds(request)
    known = ctx.view.state.adapters.get(name)
    event = await ctx.outcomes.call(DeleteAdapter(command_id=new_command_id(), name=name))
    adapter = ctx.view.state.adapters.get(name) or known
    if isinstance(event, AdapterDeleting) and adapter is not None:
        dropped = asyncio.get_running_loop().create_future()
        ctx.in_background(_drop_weights_once_deleted(ctx, adapter, dropped))  # goes on after a 202, or a hang-up
        try:
            await asyncio.wait_for(asyncio.shield(dropped), wait_s)
        except TimeoutError:
            running = open_requests_of(ctx.view.state, adapter.model_id)
            return web.json_response({"message": f"adapter {name!r} is being deleted: {running} requests still use "
                                                 "it; it is deleted when they end", "name": name, "deleting": True,
                                      "requests": running}, status=202)
    elif adapter is not None and not weights_shared(ctx.view.state, adapter):
        await delete_adapter(ctx.nc, adapter.digest)
    return web.json_response({"message": "adapter deleted", "name": name})


async def _drop_weights_once_deleted(ctx: ApiContext, adapter: Adapter, dropped: asyncio.Future[None]) -> None:
    """Once the master has deleted the adapter, its weights leave the object store unless another
    adapter shares them; `dropped` then says so to the DELETE still waiting, if any."""
    try:
        gone = await ctx.outcomes.until(lambda state: state if adapter.name not in state.adapters else None,
                                        FOLLOW_DELETION_S)
        if gone is not None and not weights_shared(gone, adapter):
            await delete_adapter(ctx.nc, adapter.digest)
    except Exception as error:
        if not dropped.done():
            dropped.set_exception(error)
        raise
    if not dropped.done():
        dropped.set_result(None)


def _wait_seconds(request: web.Request) -> float:
    raw = request.query.get("wait", "")
    try:
        wait = float(raw) if raw else DELETE_WAIT_DEFAULT_S
    except ValueError:
        raise ApiError(400, f"wait must be a number of seconds, got {raw!r}", param="wait") from None
    if not (math.isfinite(wait) and 0 <= wait <= DELETE_WAIT_MAX_S):
        raise ApiError(400, f"wait must be between 0 and {DELETE_WAIT_MAX_S:g} seconds, got {raw}", param="wait")
    return wait
