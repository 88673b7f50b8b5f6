"""Ollama's /api/pull and /api/delete over the cluster's own model routes. A pull adds the card if
the cluster does not know it (as POST /models/add does) and downloads it on every node (as POST
/download/start does on one), streaming the progress in State as Ollama prints a pull; a delete
deletes the model's files on every node and its custom card (a built-in card stays)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from exo.api.card_source import complete_card
from exo.api.context import ApiContext, context_of
from exo.api.errors import ApiError
from exo.api.ollama.wire import ModelRequest, PullRequest
from exo.api.outcomes import new_command_id
from exo.api.request_body import decode_body
from exo.bus.peers.download_control import NodeUnreachable, request_download_action
from exo.core.commands import AddCustomCard, DeleteCustomCard
from exo.core.ids import ModelId, NodeId
from exo.core.state import State
from exo.core.types import DownloadProgress, ModelCard, is_valid_model_id

# With no new progress for this long the last lines go out again: the client hears the pull is alive.
QUIET_S = 5.0
FOLD_WAIT_S = 10.0  # the nodes' deletions are in the log before they answer: folded here at once, unless it stalls
Before = dict[NodeId, DownloadProgress | None]  # per node pulling: its progress when the pull began


async def pull(request: web.Request) -> web.StreamResponse:
    body = await decode_body(request, PullRequest)
    model_id = _model_of(body.model, body.name)
    ctx = context_of(request)
    card = ctx.card(model_id) or await _add_card(ctx, model_id)
    before = {} if card.path else await _start_downloads(ctx, model_id)  # a local folder: nothing to fetch
    lines = _pull_lines(ctx, model_id, before)
    if not body.stream:
        async for line in lines:
            if "error" in line:
                raise ApiError(500, line["error"])
        return web.json_response({"status": "success"})
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    async for line in lines:
        await response.write(json.dumps(line).encode() + b"\n")
    await response.write_eof()
    return response


async def delete(request: web.Request) -> web.Response:
    body = await decode_body(request, ModelRequest)
    model_id = _model_of(body.model, body.name)
    ctx = context_of(request)
    state = ctx.view.state
    if not _downloaded_anywhere(state, model_id) and model_id not in state.custom_model_cards:
        raise ApiError(404, f"model '{model_id}' not found")
    if state.instances_of(model_id):
        raise ApiError(409, f"model '{model_id}' is loaded: unload it first (DELETE /instance/<id>, see /api/ps)")
    unreachable = []
    for node_id in sorted(state.nodes):  # files a node has but never reported go too
        try:
            await request_download_action(ctx.nc, node_id, "delete", model_id)  # "not downloaded there" is fine
        except NodeUnreachable as error:
            unreachable.append(str(error))
    if unreachable:  # the card stays, so that deleting again once those nodes are back finds the model
        raise ApiError(503, f"could not delete '{model_id}' everywhere: {'; '.join(unreachable)}")
    # Each node publishes its deletion before it answers: once folded here, /api/tags says so too.
    await ctx.outcomes.until(lambda s: True if not _downloaded_anywhere(s, model_id) else None, FOLD_WAIT_S)
    if model_id in ctx.view.state.custom_model_cards:
        await ctx.outcomes.call(DeleteCustomCard(command_id=new_command_id(), model_id=model_id))
    return web.Response()


def _downloaded_anywhere(state: State, model_id: ModelId) -> bool:
    return any(model_id in models for models in state.downloads.values())


def _model_of(model: str, name: str) -> ModelId:
    model_id = ModelId(model or name)
    if not model_id:
        raise ApiError(400, "model is required")
    if not is_valid_model_id(model_id):
        raise ApiError(400, f"invalid model name {model_id!r}")
    return model_id


async def _add_card(ctx: ApiContext, model_id: ModelId) -> ModelCard:
    """The card from the Hub (or the local model folders), added to the cluster as POST /models/add does."""
    if "/" not in model_id:
        raise ApiError(404, f"model '{model_id}' not found: pull a Hugging Face repository id such as "
                            "'mlx-community/SmolLM2-135M-Instruct'")
    same = next((known for known in ctx.all_cards() if known.lower() == model_id.lower()), None)
    if same is not None:  # Hub ids ignore case: this would be the same model under a second name
        raise ApiError(409, f"'{model_id}' is already known as '{same}'; pull that name")
    card = await complete_card(ModelCard(model_id=model_id), ctx.model_dirs)
    if problem := card.problem():
        raise ApiError(400, f"invalid model card: {problem}")
    await ctx.outcomes.call(AddCustomCard(command_id=new_command_id(), card=card))
    return card


async def _start_downloads(ctx: ApiContext, model_id: ModelId) -> Before:
    """Start the download on every node; the nodes that took it, with their progress before."""
    before: Before = {}
    refused = []
    for node_id in sorted(ctx.view.state.nodes):
        seen = ctx.view.state.download_of(node_id, model_id)
        try:
            reply = await request_download_action(ctx.nc, node_id, "start", model_id)
        except NodeUnreachable as error:
            refused.append(str(error))
            continue
        if reply.ok:
            before[node_id] = seen
        else:
            refused.append(f"{node_id}: {reply.message}")
    if not before:
        raise ApiError(503, f"no node could download '{model_id}'" + (f": {'; '.join(refused)}" if refused else
                                                                      ": no worker node has joined the cluster yet"))
    return before


async def _pull_lines(ctx: ApiContext, model_id: ModelId, before: Before) -> AsyncIterator[dict[str, Any]]:
    """Ollama's lines for the pull: the manifest, each file's bytes on every node, then success or an error."""
    yield {"status": "pulling manifest"}
    sent: dict[str, dict[str, Any]] = {}
    while before:
        progress = current_progress(ctx.view.state, model_id, before)
        for line in file_lines(model_id, progress):
            if sent.get(line["digest"]) != line:
                sent[line["digest"]] = line
                yield line
        if (error := pull_error(model_id, progress, before)) is not None:
            yield {"error": error}
            return
        if all(p is not None and p.status == "completed" for p in progress.values()):
            break
        if await ctx.outcomes.until(_changed_from(progress, model_id, before), QUIET_S) is None:
            sent.clear()  # quiet for a while: say where it stands again
    for status in ("verifying sha256 digest", "writing manifest", "success"):
        yield {"status": status}


def _changed_from(seen: dict[NodeId, DownloadProgress | None], model_id: ModelId,
                  before: Before) -> Callable[[State], bool | None]:
    return lambda state: True if current_progress(state, model_id, before) != seen else None


def current_progress(state: State, model_id: ModelId, before: Before) -> dict[NodeId, DownloadProgress | None]:
    """Per node still in the cluster: its progress since the pull began (None: nothing new yet).
    A failure from before the pull is an old one: the node is trying again."""
    progress: dict[NodeId, DownloadProgress | None] = {}
    for node_id, earlier in before.items():
        if node_id in state.nodes:
            now = state.download_of(node_id, model_id)
            stale = now is not None and now == earlier and now.status in ("failed", "cancelled")
            progress[node_id] = None if stale else now
    return progress


def file_lines(model_id: ModelId, progress: dict[NodeId, DownloadProgress | None]) -> list[dict[str, Any]]:
    """One line per file, its bytes summed over the nodes, as Ollama prints a layer: "pulling
    <short digest>". The digest names the file (a sha256 of the model id and its path), so that
    clients keep one progress bar per file; it is not the hash of the file's content."""
    totals: dict[str, list[int]] = {}
    for node_progress in progress.values():
        for file in node_progress.files if node_progress is not None else []:
            done_total = totals.setdefault(file.path, [0, 0])
            done_total[0] += file.done
            done_total[1] += file.total
    lines = []
    for path, (done, total) in sorted(totals.items()):
        digest = "sha256:" + hashlib.sha256(f"{model_id}/{path}".encode()).hexdigest()
        lines.append({"status": f"pulling {digest[7:19]}", "digest": digest, "total": total, "completed": done})
    return lines


def pull_error(model_id: ModelId, progress: dict[NodeId, DownloadProgress | None], before: Before) -> str | None:
    """Why the pull failed: a node's download failed or was cancelled, or every node left."""
    if not progress:
        return f"the nodes pulling '{model_id}' left the cluster ({', '.join(sorted(before))})"
    for node_id, node_progress in sorted(progress.items()):
        if node_progress is not None and node_progress.status in ("failed", "cancelled"):
            why = node_progress.error or f"the download of '{model_id}' was cancelled"
            return f"pulling '{model_id}' failed on node {node_id}: {why}"
    return None
