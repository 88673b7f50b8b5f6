"""Cancelling a generation by the id its surface gave it (POST /v1/cancel/{id})."""

from __future__ import annotations

import asyncio

from aiohttp import web

from exo.api.auth import current_grant
from exo.api.context import context_of
from exo.api.errors import ApiError
from exo.api.generation import cancel_generation
from exo.core.ids import CommandId

CANCEL_WAIT_S = 10.0  # how long the cancel route waits to report how the task ended
_ID_PREFIXES = ("chatcmpl-", "cmpl-", "resp_", "msg_")


async def cancel(request: web.Request) -> web.Response:
    """POST /v1/cancel/{command_id}: stop a generation (a key's own, or any for an admin); answers
    with how its task ended."""
    ctx = context_of(request)
    shown = request.match_info["command_id"]
    for prefix in _ID_PREFIXES:  # the ids the surfaces show, as well as the bare command id
        shown = shown.removeprefix(prefix)
    command_id = CommandId(shown)
    task = ctx.view.state.tasks.get(command_id)
    if task is None or not current_grant.get().owns(task):  # another key's: as if unknown
        raise ApiError(404, f"no generation {command_id!r}", param="command_id")
    if task.status in ("pending", "running"):
        ended = ctx.outcomes.expect_task_end(command_id)
        try:
            await cancel_generation(ctx, command_id)
            await asyncio.wait_for(asyncio.shield(ended), CANCEL_WAIT_S)
        except TimeoutError:
            pass  # still ending; the answer says so
        finally:
            ctx.outcomes.forget_task_end(command_id, ended)
    task = ctx.view.state.tasks.get(command_id, task)
    return web.json_response({"message": "cancel requested", "command_id": command_id, "status": task.status,
                              "finish_reason": task.finish_reason})








