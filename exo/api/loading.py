"""A generation waiting for its model (placed on demand, still loading, or waiting for room): what it
waits for, the notes its stream gets meanwhile (a client is never left in silence), and the two ends
of a wait that goes wrong: its instance's runner failed (424, as POST /place_instance with `wait`
answers) or it was not ready within EXO_LOAD_TIMEOUT_S (504). Used by exo/api/generation.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from exo.api.context import ApiContext
from exo.api.errors import ApiError, error_body, surface_of
from exo.core.adapters import split_adapter_id
from exo.core.events import TaskFinished
from exo.core.ids import CommandId, InstanceId, NodeId
from exo.core.node_names import node_display
from exo.core.state import State
from exo.core.types import Task

_DOWNLOAD_FAILED = "download failed:"  # how the worker starts the error of a runner whose download failed


class PlacementFailed(ApiError):
    """424: the instance the request waited for failed (its download or its runner), in the shape a
    failed `wait` placement has (exo/api/cluster/instances.py), with `model` as the param."""

    def __init__(self, message: str, kind: str, code: str, instance_id: InstanceId, node_id: NodeId) -> None:
        super().__init__(424, message, param="model", code=code)
        self.kind, self.instance_id, self.node_id = kind, instance_id, node_id

    def response(self, path: str = "") -> web.Response:
        body = error_body(self.status, self.message, self.param, self.code, path)
        if surface_of(path) == "openai":
            body["error"] |= {"type": self.kind, "instance_id": self.instance_id, "node_id": self.node_id}
        return web.json_response(body, status=self.status, headers=self.headers)


def placement_failure(state: State, task: Task) -> PlacementFailed | None:
    """The failed runner (lowest rank) of the task's instance, as a failed placement; None if none failed."""
    instance = state.instances.get(task.instance_id)
    if instance is None:
        return None
    for shard in sorted(instance.shards, key=lambda s: s.rank):
        runner = state.runners.get(shard.runner_id)
        if runner is None or runner.status != "failed":
            continue
        download = state.download_of(shard.node_id, split_adapter_id(instance.model_id)[0])
        by_download = download is not None and download.status == "failed" and runner.error.startswith(_DOWNLOAD_FAILED)
        code = (download.error_code or "unknown") if download is not None and by_download else "runner_failed"
        message = f"instance {instance.instance_id} failed on node {shard.node_id}: {runner.error or 'the runner failed'}"
        return PlacementFailed(message, "download_error" if by_download else "runner_error", code,
                               instance.instance_id, shard.node_id)
    return None


class LoadingWait:
    """A generation's wait for its first chunk, told to its stream (`note`) and bounded."""

    def __init__(self, ctx: ApiContext, command_id: CommandId) -> None:
        self._ctx, self._command_id = ctx, command_id
        self._started_at = time.time()  # until State has the task: it was created about now
        self.note: Callable[[str], Awaitable[None]] | None = None

    def loading(self) -> str:
        """What the task waits for before it can run ("": nothing, or it queues on a ready instance)."""
        state = self._ctx.view.state
        task = state.tasks.get(self._command_id)
        if task is None or task.status != "pending":
            return ""
        instance = state.instances.get(task.instance_id)
        if instance is None:
            desire = next((d for d in state.desires.values() if d.model_id == task.model_id), None)
            return f"waiting for an instance of {task.model_id}: {desire.waiting if desire and desire.waiting else 'placing one'}"
        if state.is_ready(instance):
            return ""
        nodes = ", ".join(node_display(state, s.node_id) for s in instance.shards)
        return f"loading {task.model_id} on {nodes}"

    async def wait(self, waiting: set[asyncio.Future[object]], first: bool) -> str:
        """Until one of `waiting` is done (""). While `first` (no chunk yet), every EXO_LOADING_NOTE_S
        the stream is told what the task waits for, and past EXO_LOAD_TIMEOUT_S with its instance
        still loading the wait ends with why (the master ends a task waiting for a placement)."""
        while True:
            done, _ = await asyncio.wait(waiting, timeout=self._timeout() if first else None,
                                         return_when=asyncio.FIRST_COMPLETED)
            if done:
                return ""
            note = self.loading()
            if why := self._waited_out(note):
                return why
            if self.note is not None and note:
                await self.note(note)

    def _timeout(self) -> float:
        task = self._ctx.view.state.tasks.get(self._command_id)
        left = (task.created_at if task else self._started_at) + self._ctx.settings.load_timeout_s - time.time()
        return min(self._ctx.settings.loading_note_s, left) if left > 0 else self._ctx.settings.loading_note_s

    def _waited_out(self, loading: str) -> str:
        task = self._ctx.view.state.tasks.get(self._command_id)
        # A task moved off a dead instance has its own bounds (exo/master/heal.py); one that only
        # left the queue for its new instance (from "") still waits for a load, and is bounded here.
        if task is None or not loading or not task.instance_id or any(m.from_instance for m in task.migrations):
            return ""
        waited = time.time() - task.created_at
        if waited < self._ctx.settings.load_timeout_s:
            return ""
        return (f"no instance of {task.model_id!r} was ready for it (waited {waited:.0f} s, the most "
                f"EXO_LOAD_TIMEOUT_S allows: {loading})")

    async def failed_placement(self, ended: asyncio.Future[TaskFinished], grace_s: float) -> PlacementFailed | None:
        """The task ended in error before its first chunk: if its instance's runner failed, why. The
        worker says a runner failed before it ends the runner's tasks, so State has it once the end is in."""
        await asyncio.wait({ended}, timeout=grace_s)
        state = self._ctx.view.state
        task = state.tasks.get(self._command_id)
        return placement_failure(state, task) if task is not None else None
