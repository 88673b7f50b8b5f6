"""This node's runner processes and how far each got: one `LocalRunner` record per runner (what
`plan` reads), its process (a `RunnerLink`), and the lifecycle steps plan chooses for it (create,
download, load, warm up, restart, abandon, kill, stop). What a runner reports moves its record on
and is published as events for the other nodes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from msgspec.structs import replace

from exo.background import Background
from exo.bus.blobs import BlobUnavailable
from exo.core.cache_reports import CacheContents
from exo.core.events import Event, RunnerStatusChanged, TaskFinished, TaskStarted
from exo.core.ids import InstanceId, ModelId, NodeId, RunnerId, TaskId
from exo.core.state import State
from exo.core.types import Instance, PromptCacheStats, RunnerStatus, ShardAssignment, TaskStatus
from exo.models.transfer import DownloadCancelled, DownloadError
from exo.runner.protocol import (
    AnyReport,
    CacheHeld,
    Cancel,
    Done,
    Failed,
    Load,
    Loaded,
    RankSetup,
    Request,
    Started,
    WarmedUp,
    WarmUp,
)
from exo.worker.plan import (
    AbandonRunner,
    CreateRunner,
    DownloadModel,
    KillHungRunner,
    LocalPhase,
    LocalRunner,
    RestartRunner,
    restart_due,
)
from exo.worker.prefill_peers import expectation_of
from exo.worker.runner_host import RunnerFactory, RunnerLink
from exo.worker.task_runs import TaskRuns

log = logging.getLogger(__name__)

STILL_RUNNING_S = 1.0  # a task still running this long after it started is announced in the log (task.started)

FetchModel = Callable[[ModelId, ShardAssignment], Awaitable[Path]]  # the files of a model's layers, on disk
FetchAdapter = Callable[[ModelId], Awaitable[Path | None]]  # the folder of the LoRA adapter a model id names


def wake_after(wake: asyncio.Event, delay: float) -> None:
    asyncio.get_running_loop().call_later(max(delay, 0.0) + 0.01, wake.set)


class Runners:
    def __init__(
        self, *, node_id: NodeId, state: Callable[[], State], new_runner: RunnerFactory,
        publish: Callable[[Event], Awaitable[None]], runs: TaskRuns, fetch_model: FetchModel,
        wake: asyncio.Event, migrate_grace_s: float, fetch_adapter: FetchAdapter,
        on_cache_held: Callable[[RunnerId, CacheContents], None] = lambda runner_id, contents: None,
    ) -> None:
        self._node_id = node_id
        self._state = state
        self._new_runner = new_runner
        self._publish = publish
        self._runs = runs  # shared with the worker: a runner's reports speak for the run it was given
        self._fetch_model = fetch_model
        self._fetch_adapter = fetch_adapter
        self._wake = wake  # set: the worker plans again
        self._on_cache_held = on_cache_held  # what a runner's prompt cache holds: for the master's routing
        self._migrate_grace_s = migrate_grace_s
        self._records: dict[RunnerId, LocalRunner] = {}
        self._hosts: dict[RunnerId, RunnerLink] = {}
        self._model_paths: dict[RunnerId, Path] = {}
        self._draft_paths: dict[RunnerId, Path] = {}  # speculative decoding's draft model, where an instance has one
        self._adapter_paths: dict[RunnerId, Path] = {}  # the LoRA adapter's folder, where the model id names one
        self._prompt_cache_stats: dict[InstanceId, PromptCacheStats] = {}  # by instance id, from runners' Done reports
        self._background = Background("runners")
        # Generations started: when, and the timer that announces them in the log if they run long.
        self._announcements: dict[tuple[RunnerId, TaskId], tuple[float, asyncio.TimerHandle]] = {}

    def records(self) -> dict[RunnerId, LocalRunner]:
        """A copy, for the plan's view."""
        return dict(self._records)

    def forget_tasks(self, done: set[TaskId]) -> None:
        """Tasks State has settled: the records need not remember them (they stay bounded)."""
        if done:
            self._records = {runner_id: replace(r, forwarded=r.forwarded - done, cancels_sent=r.cancels_sent - done,
                                                expected=r.expected - done)
                             for runner_id, r in self._records.items()}

    def prompt_caches(self) -> dict[InstanceId, PromptCacheStats]:
        """The latest prompt-cache figures of each runner this node has (for its heartbeat)."""
        live = {runner.instance_id for runner in self._records.values()}
        return {i: stats for i, stats in self._prompt_cache_stats.items() if i in live}

    async def create(self, step: CreateRunner | RestartRunner, failures: int = 0, failed_at: float = 0.0) -> None:
        self._records[step.runner_id] = LocalRunner(
            runner_id=step.runner_id, instance_id=step.instance_id, failures=failures, failed_at=failed_at)
        host = self._new_runner(step.runner_id)
        self._hosts[step.runner_id] = host
        await host.start(
            on_report=lambda report: self._on_report(step.runner_id, report),
            on_exit=lambda code, tail: self._on_exit(step.runner_id, code, tail),
        )
        self._set_phase(step.runner_id, "spawned")

    def download(self, step: DownloadModel) -> None:
        if self._set_phase(step.runner_id, "downloading"):
            self._background.start(self._download(step))

    async def _download(self, step: DownloadModel) -> None:
        """The coordinator fetches only the files this runner's layers need (see exo/models/files)."""
        await self._publish_status(step.runner_id, "downloading")
        shard = shard_of(self._state(), self._node_id, step.runner_id)
        try:
            path = await self._fetch_model(step.model_id, shard)
        except (DownloadError, DownloadCancelled) as error:  # the coordinator retried already
            await self._fail(step.runner_id, f"download failed: {error}", restartable=False)
            return
        except Exception as error:
            log.exception("download of %s failed", step.model_id)
            await self._fail(step.runner_id, f"download failed: {type(error).__name__}: {error}")
            return
        self._model_paths[step.runner_id] = path
        instance = instance_of(self._state(), step.runner_id)
        if instance is not None and instance.draft_model:  # the draft, whole, beside the model
            try:
                whole = ShardAssignment(runner_id=step.runner_id, node_id=self._node_id)
                self._draft_paths[step.runner_id] = await self._fetch_model(instance.draft_model, whole)
            except Exception as error:
                await self._fail(step.runner_id, f"download failed: the draft model {instance.draft_model}: {error}",
                                 restartable=False)
                return
        if not await self._download_adapter(step):
            return
        if self._set_phase(step.runner_id, "downloaded"):
            await self._publish_status(step.runner_id, "downloaded")  # peers wait for it to form a group

    async def _download_adapter(self, step: DownloadModel) -> bool:
        """Fetched by its hash before the runner loads (a late joiner too); False: the runner failed."""
        try:
            folder = await self._fetch_adapter(step.model_id)
        except BlobUnavailable as error:  # missing or corrupt in the store: fetching again will not help
            await self._fail(step.runner_id, f"cannot load the adapter of {step.model_id}: {error}", restartable=False)
            return False
        except OSError as error:  # e.g. a full disk: a restart may find room
            await self._fail(step.runner_id, f"cannot store the adapter of {step.model_id}: {error}")
            return False
        if folder is not None:
            self._adapter_paths[step.runner_id] = folder
        return True

    async def load(self, runner_id: RunnerId) -> None:
        state = self._state()
        instance = instance_of(state, runner_id)
        draft = self._draft_paths.get(runner_id)
        load = Load(model_path=str(self._model_paths[runner_id]), model_id=instance.model_id if instance else "",
                    shard=rank_setup(state, runner_id),
                    max_context=instance.max_context if instance else 0, kv_bits=instance.kv_bits if instance else 0,
                    draft_path=str(draft) if draft else "", num_draft_tokens=instance.num_draft_tokens if instance else 0,
                    adapter_path=str(self._adapter_paths.get(runner_id, "")),
                    serve_prefills=instance is not None and instance.role == "prefill")
        await self._send_lifecycle(runner_id, "loading", load)

    async def warm_up(self, runner_id: RunnerId) -> None:
        await self._send_lifecycle(runner_id, "warming_up", WarmUp())

    async def _send_lifecycle(self, runner_id: RunnerId, phase: LocalPhase, request: Request) -> None:
        runner = self._records.get(runner_id)
        if runner is None or runner.phase == "stopping" or not self._set_phase(runner_id, phase):
            return  # it failed or is being stopped since this step was planned: the next plan decides
        await self._publish_status(runner_id, phase)  # type: ignore[arg-type]
        await self._hosts[runner_id].send(request)

    def note_forwarded(self, runner_id: RunnerId, task_id: TaskId) -> None:
        runner = self._records[runner_id]
        self._records[runner_id] = replace(runner, forwarded=runner.forwarded | {task_id})

    async def send(self, runner_id: RunnerId, request: Request) -> None:
        await self._hosts[runner_id].send(request)

    async def expect_prefill(self, runner_id: RunnerId, task_id: TaskId) -> None:
        runner = self._records.get(runner_id)
        task = self._state().tasks.get(task_id)
        if runner is None or task is None:
            return
        self._records[runner_id] = replace(runner, expected=runner.expected | {task_id})
        if (expectation := expectation_of(self._state(), task)) is not None:  # None: its asker has no key: nobody may ask
            await self._hosts[runner_id].send(expectation)

    async def cancel(self, runner_id: RunnerId, task_id: TaskId) -> None:
        runner = self._records[runner_id]
        self._records[runner_id] = replace(runner, cancels_sent=runner.cancels_sent | {task_id})
        await self._hosts[runner_id].send(Cancel(task_id=task_id))

    async def _on_report(self, runner_id: RunnerId, report: AnyReport) -> None:
        if runner_id in self._records:
            self._records[runner_id] = replace(self._records[runner_id], heard_at=time.monotonic())
        match report:
            case Loaded():
                self._set_phase(runner_id, "loaded", prefill_port=report.prefill_port)
            case WarmedUp():
                self._set_phase(runner_id, "ready", failures=0)
                await self._publish_status(runner_id, "ready", warm_up_s=report.seconds)
            case Started():
                self._announce_later(runner_id, report.task_id)
            case Done():
                await self._on_done(runner_id, report)
            case Failed():
                await self._fail(runner_id, report.error)
            case CacheHeld():
                self._on_cache_held(runner_id, report.contents)

    def _announce_later(self, runner_id: RunnerId, task_id: TaskId) -> None:
        """`task.started` goes to the log only for a task still running STILL_RUNNING_S after it
        started: most requests end sooner, and a restart learns what its runners had begun from
        forward_journal.py, not from State. Nothing but operators and the dashboard reads it."""
        attempt = self._runs.run_given(runner_id, task_id)
        self._announcements[runner_id, task_id] = (time.monotonic(), asyncio.get_running_loop().call_later(
            STILL_RUNNING_S, self._announce_if_running, runner_id, task_id, attempt))

    def _announce_if_running(self, runner_id: RunnerId, task_id: TaskId, attempt: int) -> None:
        task = self._state().tasks.get(task_id)
        if task is None or task.status != "pending" or len(task.migrations) != attempt \
                or task_id in self._runs.ended_ids() or self._runs.run_given(runner_id, task_id) != attempt:
            return
        self._background.start(self._announce(TaskStarted(task_id=task_id, attempt=attempt)))

    async def _announce(self, event: TaskStarted) -> None:
        await self._publish(event)

    async def _on_done(self, runner_id: RunnerId, report: Done) -> None:
        started_at, announcement = self._announcements.pop((runner_id, report.task_id), (0.0, None))
        if announcement is not None:
            announcement.cancel()
        run = self._runs.finished(runner_id, report.task_id)
        runner = self._records.get(runner_id)
        if report.prompt_cache is not None and runner is not None:
            self._prompt_cache_stats[runner.instance_id] = report.prompt_cache
        statuses: dict[str, TaskStatus] = {"error": "failed", "cancelled": "cancelled"}
        await self._publish(TaskFinished(
            task_id=report.task_id, status=statuses.get(report.finish_reason, "completed"),
            finish_reason=report.finish_reason, error=report.error, prompt_tokens=report.prompt_tokens,
            completion_tokens=report.completion_tokens, cached_tokens=report.cached_tokens, attempt=run,
            audio_seconds=report.audio_seconds,
            generation_s=round(time.monotonic() - started_at, 4) if started_at else 0.0, at=time.time(),
        ))

    async def _on_exit(self, runner_id: RunnerId, code: int, log_tail: str) -> None:
        await self._fail(runner_id, f"runner exited with code {code}: {log_tail}")

    async def kill_hung(self, step: KillHungRunner) -> None:
        log.error("worker: runner %s is hung (%s): killing it", step.runner_id, step.reason)
        self._hosts[step.runner_id].kill()
        await self._fail(step.runner_id, f"the runner was hung: {step.reason}")

    async def _fail(self, runner_id: RunnerId, error: str, restartable: bool = True) -> None:
        for key in [key for key in self._announcements if key[0] == runner_id]:  # its generations end unreported
            self._announcements.pop(key)[1].cancel()
        runner = self._records.get(runner_id)
        if runner is None or runner.phase in ("failed", "stopping"):
            return
        self._set_phase(runner_id, "failed", error=error, failures=runner.failures + 1, failed_at=time.monotonic(),
                        restartable=restartable)
        await self._publish_status(runner_id, "failed", error)
        self._wake_for_restart_and_migration(runner_id)

    async def abandon(self, step: AbandonRunner) -> None:
        """A peer rank failed: stop ours too (not our failure) and rejoin when the peer is back."""
        log.warning("worker: runner %s stops: %s", step.runner_id, step.reason)
        host = self._hosts.get(step.runner_id)
        if host is not None:
            host.kill()
        self._set_phase(step.runner_id, "failed", error=step.reason, failed_at=time.monotonic())
        await self._publish_status(step.runner_id, "stopped", step.reason)
        self._wake_for_restart_and_migration(step.runner_id)

    def _wake_for_restart_and_migration(self, runner_id: RunnerId) -> None:
        wake_after(self._wake, restart_due(self._records[runner_id]) - time.monotonic())
        wake_after(self._wake, self._migrate_grace_s)  # its tasks, if held for the master to move (plan.py), end then

    async def restart(self, step: RestartRunner) -> None:
        failures, failed_at = self._records[step.runner_id].failures, self._records[step.runner_id].failed_at
        log.warning("worker: restarting runner %s (failures so far: %d)", step.runner_id, failures)
        host = self._hosts.pop(step.runner_id, None)
        if host is not None:
            host.kill()
        self._model_paths.pop(step.runner_id, None)
        self._draft_paths.pop(step.runner_id, None)
        self._adapter_paths.pop(step.runner_id, None)
        await self.create(step, failures, failed_at)

    def stop(self, runner_id: RunnerId) -> None:
        # Only a ready runner reads a Shutdown soon; one loading (its ring join may wait for a
        # peer that is gone) is killed at once: its port must be free for a replacement's group.
        graceful = self._records[runner_id].phase == "ready"
        self._set_phase(runner_id, "stopping")
        self._background.start(self._stop(runner_id, graceful))

    async def _stop(self, runner_id: RunnerId, graceful: bool) -> None:
        host = self._hosts.pop(runner_id, None)
        runner = self._records.get(runner_id)
        if host is not None and runner is not None and graceful:
            for task_id in runner.forwarded - self._runs.ended_ids():  # stop a generation in progress first
                await host.send(Cancel(task_id=task_id))
        if host is not None:
            await host.stop(timeout=5.0 if graceful else 0.0)
        self._records.pop(runner_id, None)
        self._model_paths.pop(runner_id, None)
        self._draft_paths.pop(runner_id, None)
        self._adapter_paths.pop(runner_id, None)
        self._wake.set()  # a group waiting for this node's stopping runner to leave may form now (plan.py)

    async def stop_all(self) -> None:
        self._background.cancel_all()
        await asyncio.gather(*(host.stop() for host in self._hosts.values()), return_exceptions=True)

    def kill_all(self) -> None:
        for host in self._hosts.values():
            host.kill()

    def _set_phase(self, runner_id: RunnerId, phase: LocalPhase, **changes: Any) -> bool:
        """False when the runner failed meanwhile: a step planned before it died (a download that
        finished, a load) must not hide the failure, or nothing would ever restart it."""
        runner = self._records.get(runner_id)
        if runner is not None and runner.phase == "failed" and phase not in ("failed", "stopping"):
            log.info("worker: runner %s failed meanwhile; not moving it to %s", runner_id, phase)
            return False
        if runner is not None:
            self._records[runner_id] = replace(runner, phase=phase, **changes)
        self._wake.set()
        return True

    async def _publish_status(self, runner_id: RunnerId, status: RunnerStatus, error: str = "",
                              warm_up_s: float = 0.0) -> None:
        runner = self._records[runner_id]
        if runner.phase == "failed" and status not in ("failed", "stopped"):
            return  # it failed since this step began: State must keep saying so (the master counts failures there)
        await self._publish(RunnerStatusChanged(
            runner_id=runner_id, instance_id=runner.instance_id, node_id=self._node_id, status=status, error=error,
            failures=runner.failures, at=time.time(), warm_up_s=warm_up_s,
            prefill_address=self._prefill_address(runner) if status == "ready" else "",
        ))

    def _prefill_address(self, runner: LocalRunner) -> str:
        """Where peers reach a prefill runner: this node's first address (as placement's ring does)."""
        node = self._state().nodes.get(self._node_id)
        if not runner.prefill_port or node is None or not node.addresses:
            return ""
        host = node.addresses[0]
        return f"[{host}]:{runner.prefill_port}" if ":" in host else f"{host}:{runner.prefill_port}"


def instance_of(state: State, runner_id: RunnerId) -> Instance | None:
    runner = state.runners.get(runner_id)
    return state.instances.get(runner.instance_id) if runner else None


def shard_of(state: State, node_id: NodeId, runner_id: RunnerId) -> ShardAssignment:
    instance = instance_of(state, runner_id)
    shards = [s for s in instance.shards if s.runner_id == runner_id] if instance else []
    return shards[0] if shards else ShardAssignment(runner_id=runner_id, node_id=node_id)  # all layers


def rank_setup(state: State, runner_id: RunnerId) -> RankSetup | None:
    """Where this runner sits in its instance's ring group; None for a one-node instance."""
    instance = instance_of(state, runner_id)
    if instance is None or len(instance.shards) < 2:
        return None
    shards = sorted(instance.shards, key=lambda s: s.rank)
    mine = next(s for s in shards if s.runner_id == runner_id)
    return RankSetup(rank=mine.rank, ring_hosts=[s.ring_address for s in shards], sharding=instance.sharding,
                     start_layer=mine.start_layer, end_layer=mine.end_layer)
