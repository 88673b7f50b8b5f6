"""Instances and their desires (exo's routes): place one (with previews beforehand and an
Idempotency-Key for retries), report how far it is, delete it; list and end desires."""

from __future__ import annotations

import math
import time
from typing import Any

import msgspec
from aiohttp import web

from exo.api.cluster.wire import DownloadReport, InstanceReport, PlaceInstanceRequest, RunnerReport
from exo.api.context import context_of
from exo.api.errors import ApiError, error_body
from exo.api.idempotency import command_id_for, earlier_placement
from exo.api.keep_alive import NEVER, keep_alive_seconds
from exo.api.outcomes import new_command_id
from exo.api.request_body import decode_body
from exo.api.validate import check_kv_bits, check_max_context
from exo.core.adapters import split_adapter_id
from exo.core.commands import DeleteDesire, DeleteInstance, PlaceInstance, replica_bounds_problem
from exo.core.events import InstanceCreated
from exo.core.ids import InstanceId, ModelId, NodeId, RunnerId
from exo.core.node_names import node_display
from exo.core.placement import human_bytes, placement_previews
from exo.core.state import State
from exo.core.types import Instance

# `wait` on POST /place_instance: true waits this long; a number of seconds, at most the bound.
PLACE_WAIT_DEFAULT_S = 600.0
PLACE_WAIT_MAX_S = 3600.0
MAX_REPLICAS = 64  # as the master's (exo/master/decide.py)
FOLD_WAIT_S = 10.0  # a command's later events follow its answer in the same append: at once, unless the node stalls
# How far a runner has come, least first: an instance is as far as its least advanced runner.
_PROGRESS = ("created", "downloading", "downloaded", "loading", "warming_up", "ready")
_DOWNLOAD_FAILED = "download failed:"  # how the worker starts the error of a runner whose download failed


def report_of(state: State, instance: Instance) -> InstanceReport:
    runners = [_runner_report(state, instance, shard.runner_id, shard.node_id, shard.rank)
               for shard in sorted(instance.shards, key=lambda s: s.rank)]
    statuses = [r.status for r in runners]
    failed = next((r for r in runners if r.status == "failed"), None)
    if failed is not None:
        download = failed.download
        # The runner failed because its download did (the record is failed, and the runner says so).
        by_download = download is not None and download.status == "failed" and failed.error.startswith(_DOWNLOAD_FAILED)
        code = (download.error_code or "unknown") if download is not None and by_download else "runner_failed"
        error = failed.error or "the runner failed"
        return InstanceReport(status="failed", error=error, error_code=code, runners=runners)
    if "stopped" in statuses:
        status = "stopped"
    elif not statuses:
        status = "created"
    else:
        status = min(statuses, key=lambda s: _PROGRESS.index(s) if s in _PROGRESS else 0)
    return InstanceReport(status=status, runners=runners)


def _runner_report(state: State, instance: Instance, runner_id: RunnerId, node_id: NodeId, rank: int) -> RunnerReport:
    runner = state.runners.get(runner_id)
    record = state.download_of(node_id, split_adapter_id(instance.model_id)[0])  # an adapter's: its base's
    download = None if record is None else DownloadReport(
        status=record.status, done_bytes=record.done_bytes, total_bytes=record.total_bytes, speed_bps=record.speed_bps,
        eta_s=record.eta_s, source=record.source, error_code=record.error_code, error=record.error)
    return RunnerReport(runner_id=runner_id, node_id=node_id, rank=rank, status=runner.status if runner else "created",
                        error=runner.error if runner else "", download=download,
                        failures=runner.failures if runner else 0)


def _wait_seconds(request: web.Request, body: PlaceInstanceRequest) -> float:
    """0 (answer at once, the default), or how long to wait for the instance to be ready or fail."""
    wait: object = body.wait
    if wait is None and "wait" in request.query:
        raw = request.query["wait"].strip().lower()
        if raw in ("", "true", "false"):
            wait = raw != "false"
        else:
            try:
                wait = float(raw)
            except ValueError:
                raise ApiError(400, f"wait must be true, false or a number of seconds, got {raw!r}",
                               param="wait") from None
    if wait is None or wait is False:
        return 0.0
    if wait is True:
        return PLACE_WAIT_DEFAULT_S
    assert isinstance(wait, float)
    if not (math.isfinite(wait) and 0 <= wait <= PLACE_WAIT_MAX_S):
        raise ApiError(400, f"wait must be between 0 and {PLACE_WAIT_MAX_S:g} seconds, got {wait:g}", param="wait")
    return wait


def _placed_keep_alive(value: str | int | float | None) -> float:
    """An explicit placement stays until deleted (negative) unless given a keep_alive; 0 is refused:
    it would unload the instance before anyone could use it."""
    seconds = keep_alive_seconds(value)
    if seconds == 0:
        raise ApiError(400, "keep_alive 0 would unload the instance as soon as it is placed: give a duration, or "
                            "leave it out to keep it until deleted", param="keep_alive")
    return NEVER if seconds is None else seconds


async def place_instance(request: web.Request) -> web.Response:
    body = await decode_body(request, PlaceInstanceRequest)
    ctx = context_of(request)
    ctx.card_or_404(body.model_id)
    if not 0 <= body.max_queue <= 100_000:
        raise ApiError(400, "max_queue must be between 0 (the default) and 100000", param="max_queue")
    check_max_context(body.max_context, ctx.require_card(body.model_id))
    check_kv_bits(body.kv_bits)
    if not 1 <= body.replicas <= MAX_REPLICAS:
        raise ApiError(400, f"replicas must be between 1 and {MAX_REPLICAS}, not {body.replicas}", param="replicas")
    if problem := replica_bounds_problem(body.min_replicas, body.replicas, body.max_replicas, MAX_REPLICAS):
        raise ApiError(400, problem[1], param=problem[0])
    wait_s = _wait_seconds(request, body)
    keep_alive_s = _placed_keep_alive(body.keep_alive)
    command_id = command_id_for(request)
    instance = None if command_id is None else earlier_placement(ctx.view.state, command_id, body.model_id)
    evicted: list[Any] = []  # unloaded to make room for it (a retry's earlier placement says none)
    if instance is None:
        command = PlaceInstance(command_id=command_id or new_command_id(), model_id=body.model_id,
                                sharding=body.sharding, min_nodes=body.min_nodes, max_queue=body.max_queue,
                                max_context=body.max_context, kv_bits=body.kv_bits, force=body.force,
                                replicas=body.replicas, min_replicas=body.min_replicas,
                                max_replicas=body.max_replicas, draft_model=body.draft_model,
                                num_draft_tokens=body.num_draft_tokens, keep_alive_s=keep_alive_s, at=time.time(),
                                role=body.role)
        event = await ctx.outcomes.call(command)
        assert isinstance(event, InstanceCreated)
        instance, evicted = event.instance, msgspec.to_builtins(event.evicted)
        if command_id is not None:  # a request with the same key may have been decided first
            instance = earlier_placement(ctx.view.state, command_id, body.model_id) or instance
    instance_id = instance.instance_id
    placed = {"command_id": instance.command_id, "instance_id": instance_id, "instance": msgspec.to_builtins(instance),
              "evicted": evicted}
    if wait_s <= 0:
        return web.json_response({"message": "instance placed", **placed})

    def settled(state: State) -> State | None:
        instance = state.instances.get(instance_id)
        ended = instance is None or report_of(state, instance).status in ("ready", "failed", "stopped")
        return state if ended else None

    # After `wait_s` without an end, State as it is then: placed, on its way, not ready yet (202).
    state = await ctx.outcomes.until(settled, wait_s) or ctx.view.state
    instance = state.instances.get(instance_id)
    report = None if instance is None else report_of(state, instance)
    if report is None or report.status in ("failed", "stopped"):
        return _instance_failed(state, instance_id, body.model_id, report, request.path)
    if report.status == "ready":
        return web.json_response({"message": "instance ready", **placed, **_report_fields(report)})
    return web.json_response({"message": f"instance placed; not ready after {wait_s:g} s", **placed,
                              **_report_fields(report)}, status=202)


def _report_fields(report: InstanceReport) -> dict[str, Any]:
    fields: dict[str, Any] = msgspec.to_builtins(report)
    return fields


def _instance_failed(state: State, instance_id: InstanceId, model_id: ModelId, report: InstanceReport | None,
                     path: str) -> web.Response:
    """424 (the placement depended on a download or a runner that failed), OpenAI's error shape,
    with the download's error code (`not_found`, `gated`, ...) as the code when a download failed."""
    failed = report.failed_runner if report is not None else None
    node_id = failed.node_id if failed is not None else ""
    if report is None:
        # The reason of the model's most recent deletion, when this State records it.
        reason = getattr(state, "instance_end_reasons", {}).get(model_id, "") or "deleted"
        message, kind, code = f"instance {instance_id} was deleted: {reason}", "runner_error", "instance_deleted"
    elif failed is None:
        message, kind, code = f"instance {instance_id} stopped before it was ready", "runner_error", "runner_stopped"
    else:
        message = f"instance {instance_id} failed on node {node_id}: {report.error}"
        kind = "runner_error" if report.error_code == "runner_failed" else "download_error"
        code = report.error_code
    body = error_body(424, message, param="model_id", code=code, path=path)
    body["error"] |= {"type": kind, "instance_id": instance_id, "node_id": node_id}
    return web.json_response(body, status=424)


async def get_instance(request: web.Request) -> web.Response:
    state = context_of(request).view.state
    instance = state.instances.get(InstanceId(request.match_info["instance_id"]))
    if instance is None:
        raise ApiError(404, f"unknown instance {request.match_info['instance_id']!r}")
    return web.json_response({**msgspec.to_builtins(instance), **_report_fields(report_of(state, instance))})


async def delete_instance(request: web.Request) -> web.Response:
    instance_id = InstanceId(request.match_info["instance_id"])
    command = DeleteInstance(command_id=new_command_id(), instance_id=instance_id)
    outcomes = context_of(request).outcomes
    await outcomes.call(command)
    # The answer can be the first of several events (its desire's end comes first): answer once
    # this node's State has the instance gone, so the caller's next request (a retried placement
    # with the same Idempotency-Key) sees it gone.
    await outcomes.until(lambda state: True if instance_id not in state.instances else None, FOLD_WAIT_S)
    return web.json_response({"message": "instance deleted", "command_id": command.command_id, "instance_id": instance_id})


async def delete_desire(request: web.Request) -> web.Response:
    """End a desire: its instances go, and nothing places them again."""
    desire_id = request.match_info["desire_id"]
    command = DeleteDesire(command_id=new_command_id(), desire_id=desire_id)
    outcomes = context_of(request).outcomes
    await outcomes.call(command)  # answered by its first instance's deletion: wait for the desire's end too
    await outcomes.until(lambda state: True if desire_id not in state.desires else None, FOLD_WAIT_S)
    return web.json_response({"message": "desire deleted", "command_id": command.command_id, "desire_id": desire_id})


async def list_desires(request: web.Request) -> web.Response:
    """Each desire with its instances, and why it waits if it is short of its replicas."""
    state = context_of(request).view.state
    return web.json_response({"desires": [
        {**msgspec.to_builtins(d), "instances": [i.instance_id for i in state.instances_of_desire(d.desire_id)]}
        for d in sorted(state.desires.values(), key=lambda d: d.desire_id)]})














async def instance_previews(request: web.Request) -> web.Response:
    """GET /instance/previews?model_id=X: each sharding on each node count 1..N, or why not; places nothing."""
    ctx = context_of(request)
    model_id = ModelId(request.query.get("model_id", ""))
    card = ctx.card_or_404(model_id)
    max_context = check_max_context(_query_int(request, "max_context"), card)
    kv_bits = check_kv_bits(_query_int(request, "kv_bits"))
    force = request.query.get("force", "").strip().lower() in ("1", "true", "yes")
    state = ctx.view.state
    previews = []
    for preview in placement_previews(card, state, max_context, kv_bits, force):
        # min_nodes: what to send to POST /place_instance to get this placement.
        shown: dict[str, object] = {"model_id": model_id, "sharding": preview.sharding, "min_nodes": preview.node_count,
                 "node_count": preview.node_count, "max_context": preview.instance.max_context if preview.instance else None}
        if preview.rejection is not None or preview.instance is None:
            assert preview.rejection is not None
            previews.append(shown | {"instance": None, "error": preview.rejection.reason,
                                     "code": preview.rejection.code})
        else:
            previews.append(shown | {"instance": msgspec.to_builtins(preview.instance), "error": None, "code": None,
                                     "ranks": _ranks_shown(preview.instance, state)})
    return web.json_response({"previews": previews})


def _ranks_shown(instance: Instance, state: State) -> list[dict[str, object]]:
    """Per rank, what a person checks before placing: where, which layers, memory for weights and KV cache."""
    ranks: list[dict[str, object]] = []
    for shard in instance.shards:
        node = state.nodes.get(shard.node_id)
        ranks.append({"rank": shard.rank, "node_id": shard.node_id, "node": node_display(state, shard.node_id),
                      "layers": [shard.start_layer, shard.end_layer], "weights_bytes": shard.memory_bytes,
                      "kv_bytes": shard.kv_bytes, "max_context": instance.max_context,
                      "memory": f"{human_bytes(shard.memory_bytes)} weights + {human_bytes(shard.kv_bytes)} KV cache",
                      "free_bytes": node.memory_available if node else 0})
    return ranks


def _query_int(request: web.Request, name: str) -> int:
    try:
        return int(request.query.get(name, "0"))
    except ValueError:
        raise ApiError(400, f"{name} must be a whole number", param=name) from None
