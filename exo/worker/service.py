"""The worker: keeps State, asks `plan` what to do for the runners bound to this node, does it.

Local facts (which runner processes exist and how far each got) live in `LocalRunner`
records; everything other nodes need to know is published as an event.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any

from msgspec.structs import replace

from exo.background import Background
from exo.bus.connection import Connection
from exo.bus.event_log import EventLog
from exo.bus.state_view import StateView
from exo.bus.token_stream import publish_chunk, resume_point
from exo.core.catalogue import find_card
from exo.core.events import AnyEvent, CustomCardAdded, CustomCardDeleted, Event, RunnerStatusChanged, TaskFinished, TaskStarted
from exo.core.ids import InstanceId, ModelId, NodeId, RunnerId, TaskId
from exo.core.state import State
from exo.core.types import (
    FinishReason,
    Instance,
    ModelCard,
    PromptCacheStats,
    RunnerStatus,
    SamplingDefaults,
    ShardAssignment,
    Task,
    TaskStatus,
    TokenChunk,
)
from exo.models.cards import reconcile_custom_card, reconcile_custom_cards
from exo.models.dirs import DownloadSettings
from exo.models.transfer import DownloadCancelled, DownloadError
from exo.runner.protocol import (
    AnyReport,
    Cancel,
    Done,
    Failed,
    Generate,
    Load,
    Loaded,
    RankSetup,
    Request,
    Resume,
    RunnerStart,
    Started,
    WarmedUp,
    WarmUp,
)
from exo.settings.services import MasterSettings, ModelSettings, WorkerSettings
from exo.worker.downloads import DownloadCoordinator
from exo.worker.plan import (
    AbandonRunner,
    CancelForwardedTask,
    CreateRunner,
    DownloadModel,
    EndTask,
    FetchImages,
    ForwardTask,
    KillHungRunner,
    LoadModel,
    LocalPhase,
    LocalRunner,
    RestartRunner,
    Step,
    StopRunner,
    WarmUpRunner,
    WorkerView,
    busy,
    images_needed,
    images_of,
    images_to_fetch,
    nodes_concerned,
    plan,
    restart_due,
    tasks_needing,
)
from exo.worker.runner_host import RunnerFactory, RunnerHost, RunnerLink
from exo.worker.task_images import TaskImages
from exo.worker.task_runs import TaskRuns, run_of

log = logging.getLogger(__name__)

# A multi-node instance's failed runner may have lost a peer machine: its tasks wait for the master
# to suspect that machine (EXO_SUSPECT_S) and move them, this much longer, before this node ends
# them with the error.
MIGRATE_MARGIN_S = 3.0


class Worker:
    def __init__(
        self, nc: Connection, view: StateView, node_id: NodeId, data_dir: Path,
        nats_urls: list[str], builtin_cards: Mapping[ModelId, ModelCard], download_settings: DownloadSettings | None = None,
        runner_factory: RunnerFactory | None = None, *, settings: WorkerSettings = WorkerSettings(),
        runner_start: RunnerStart | None = None, suspect_s: float = MasterSettings().suspect_s,
    ) -> None:
        self.node_id = node_id
        self._nc = nc
        self._view = view
        self._log = EventLog(nc)
        self._data_dir = data_dir
        self._builtin_cards = builtin_cards
        self._runners: dict[RunnerId, LocalRunner] = {}
        self._prompt_cache_stats: dict[InstanceId, PromptCacheStats] = {}  # by instance id, from runners' Done reports
        self._hosts: dict[RunnerId, RunnerLink] = {}
        self._settings = settings
        # A runner that has work and shows no progress for settings.runner_stall_s (no Alive report: its
        # model thread is stuck, or the process is stopped) is hung.
        self._migrate_grace_s = suspect_s + MIGRATE_MARGIN_S
        downloads = download_settings or DownloadSettings.of(ModelSettings(), data_dir)
        start = runner_start or RunnerStart(nats_urls=nats_urls)
        self._new_runner = runner_factory or (
            lambda runner_id: RunnerHost(runner_id, start, data_dir / "logs", offline=downloads.offline))
        self._model_paths: dict[RunnerId, Path] = {}
        self._runs = TaskRuns()  # which run of each task this node forwarded and ended
        self._images = TaskImages(nc, self.images_dir, self._fail_tasks_needing, lambda: images_needed(self._worker_view()),
                                  settings.image_cache_bytes)
        self._wake = asyncio.Event()
        self._background = Background("worker")
        self.downloads = DownloadCoordinator(
            nc, node_id, downloads, self._publish,
            lambda: self._view.state, lambda model_id: find_card(self._view.state, builtin_cards, model_id),
        )
        view.add_listener(self._on_event)

    @property
    def custom_cards_dir(self) -> Path:
        return self._data_dir / "custom_cards"

    @property
    def images_dir(self) -> Path:
        return self._data_dir / "images"

    async def run(self) -> None:
        # A late joiner first makes its disk match State (cards, then the images its pending
        # tasks need); only then does it plan anything.
        reconcile_custom_cards(self.custom_cards_dir, self._view.state.custom_model_cards)
        await self.downloads.start()
        await self._fetch_images(images_to_fetch(self._worker_view()))
        self._images.trim()
        log.info("worker: disk reconciled with State at sequence %d; planning starts", self._view.state.last_seq)
        self._in_background(self._watch_busy_runners())
        self._wake.set()
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._forget_settled()
            self._images.trim()
            for step in plan(self._worker_view()):
                try:
                    await self._execute(step)
                except Exception:  # one failed step must not stop the worker; the next plan retries
                    log.exception("step %s failed", step)
                    self._wake_after(1.0)  # soon, whether or not an event about this node comes

    async def _watch_busy_runners(self) -> None:
        """Plan again every second while a runner has work, so a hung one is found (plan.KillHungRunner)."""
        while True:
            await asyncio.sleep(1.0)
            view = self._worker_view()
            if any(busy(view, runner) for runner in view.runners.values()):
                self._wake.set()

    async def stop(self) -> None:
        await self.downloads.stop()
        self._background.cancel_all()
        await asyncio.gather(*(host.stop() for host in self._hosts.values()), return_exceptions=True)

    def kill_runners(self) -> None:
        for host in self._hosts.values():
            host.kill()

    def _forget_settled(self) -> None:
        done = self._runs.forget_settled(self._view.state)
        if done:
            self._runners = {runner_id: replace(r, forwarded=r.forwarded - done, cancels_sent=r.cancels_sent - done)
                             for runner_id, r in self._runners.items()}

    def _worker_view(self) -> WorkerView:
        return WorkerView(
            node_id=self.node_id, state=self._view.state, runners=dict(self._runners), ended_tasks=self._runs.current_ends(self._view.state),
            local_images=self._images.cache.digests(), images_in_flight=frozenset(self._images.in_flight),
            now=time.monotonic(), stall_after=self._settings.runner_stall_s, migrate_grace=self._migrate_grace_s,
        )

    def _on_event(self, seq: int, event: AnyEvent, state: State) -> None:
        # One card event touches one file (a whole-folder reconcile per event fell behind the log:
        # docs/reliability.md). State, not the event, says what the file must be: the reducer may
        # have skipped the event.
        if isinstance(event, (CustomCardAdded, CustomCardDeleted)):
            model_id = event.card.model_id if isinstance(event, CustomCardAdded) else event.model_id
            reconcile_custom_card(self.custom_cards_dir, model_id, state.custom_model_cards.get(model_id))
        concerned = nodes_concerned(state, event)
        if concerned is None or self.node_id in concerned:
            self._wake.set()

    def _set_phase(self, runner_id: RunnerId, phase: LocalPhase, **changes: Any) -> bool:
        """False when the runner failed meanwhile: a step planned before it died (a download that
        finished, a load) must not hide the failure, or nothing would ever restart it."""
        runner = self._runners.get(runner_id)
        if runner is not None and runner.phase == "failed" and phase not in ("failed", "stopping"):
            log.info("worker: runner %s failed meanwhile; not moving it to %s", runner_id, phase)
            return False
        if runner is not None:
            self._runners[runner_id] = replace(runner, phase=phase, **changes)
        self._wake.set()
        return True

    async def _publish(self, event: Event) -> None:
        await self._log.append(event, event_id=uuid.uuid4().hex)

    async def _publish_status(self, runner_id: RunnerId, status: RunnerStatus, error: str = "") -> None:
        runner = self._runners[runner_id]
        if runner.phase == "failed" and status not in ("failed", "stopped"):
            return  # it failed since this step began: State must keep saying so (the master counts failures there)
        await self._publish(RunnerStatusChanged(
            runner_id=runner_id, instance_id=runner.instance_id, node_id=self.node_id, status=status, error=error,
            failures=runner.failures,
        ))

    def _in_background(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        self._background.start(coroutine)

    async def _execute(self, step: Step) -> None:
        log.debug("step %s", step)
        match step:
            case CreateRunner():
                await self._create_runner(step)
            case DownloadModel():
                if self._set_phase(step.runner_id, "downloading"):
                    self._in_background(self._download(step))
            case LoadModel():
                instance = self._instance_of(step.runner_id)
                load = Load(model_path=str(self._model_paths[step.runner_id]), shard=self._rank_setup(step.runner_id),
                               max_context=instance.max_context if instance else 0,
                               kv_bits=instance.kv_bits if instance else 0)
                await self._send_lifecycle(step.runner_id, "loading", load)
            case WarmUpRunner():
                await self._send_lifecycle(step.runner_id, "warming_up", WarmUp())
            case ForwardTask():
                await self._forward(step)
            case CancelForwardedTask():
                runner = self._runners[step.runner_id]
                self._runners[step.runner_id] = replace(runner, cancels_sent=runner.cancels_sent | {step.task_id})
                await self._hosts[step.runner_id].send(Cancel(task_id=step.task_id))
            case FetchImages():
                self._images.in_flight.update(step.digests)
                self._in_background(self._fetch_images(step.digests))
            case EndTask():
                await self._end_task(step.task_id, step.status, step.reason)
            case RestartRunner():
                await self._restart_runner(step)
            case AbandonRunner():
                await self._abandon_runner(step)
            case KillHungRunner():
                log.error("worker: runner %s is hung (%s): killing it", step.runner_id, step.reason)
                self._hosts[step.runner_id].kill()
                await self._fail_runner(step.runner_id, f"the runner was hung: {step.reason}")
            case StopRunner():
                # Only a ready runner reads a Shutdown soon; one loading (its ring join may wait for a
                # peer that is gone) is killed at once: its port must be free for a replacement's group.
                graceful = self._runners[step.runner_id].phase == "ready"
                self._set_phase(step.runner_id, "stopping")
                self._in_background(self._stop_runner(step.runner_id, graceful))

    async def _fetch_images(self, digests: list[str]) -> None:
        await self._images.fetch(digests)
        self._wake.set()

    def _fail_tasks_needing(self, digest: str, reason: str) -> None:
        for task_id in tasks_needing(self._worker_view(), digest):
            self._runs.ended(self._view.state, task_id)  # now, not when _end_task runs: the next plan must not fetch it again
            self._in_background(self._end_task(task_id, "failed", reason))

    async def _create_runner(self, step: CreateRunner | RestartRunner, failures: int = 0,
                             failed_at: float = 0.0) -> None:
        self._runners[step.runner_id] = LocalRunner(
            runner_id=step.runner_id, instance_id=step.instance_id, failures=failures, failed_at=failed_at)
        host = self._new_runner(step.runner_id)
        self._hosts[step.runner_id] = host
        await host.start(
            on_report=lambda report: self._on_report(step.runner_id, report),
            on_exit=lambda code, tail: self._on_runner_exit(step.runner_id, code, tail),
        )
        self._set_phase(step.runner_id, "spawned")

    async def _download(self, step: DownloadModel) -> None:
        """The coordinator fetches only the files this runner's layers need (see exo/models/files)."""
        await self._publish_status(step.runner_id, "downloading")
        card = find_card(self._view.state, self._builtin_cards, step.model_id)
        shard = self._shard_of(step.runner_id)
        try:
            if card is None:
                raise DownloadError("not_found", f"no model card for {step.model_id}")
            path = await self.downloads.ensure(card, shard.start_layer, shard.end_layer)
        except (DownloadError, DownloadCancelled) as error:  # the coordinator retried already
            await self._fail_runner(step.runner_id, f"download failed: {error}", restartable=False)
            return
        except Exception as error:
            log.exception("download of %s failed", step.model_id)
            await self._fail_runner(step.runner_id, f"download failed: {type(error).__name__}: {error}")
            return
        self._model_paths[step.runner_id] = path
        if self._set_phase(step.runner_id, "downloaded"):
            await self._publish_status(step.runner_id, "downloaded")  # peers wait for it to form a group

    def _shard_of(self, runner_id: RunnerId) -> ShardAssignment:
        instance = self._instance_of(runner_id)
        shards = [s for s in instance.shards if s.runner_id == runner_id] if instance else []
        return shards[0] if shards else ShardAssignment(runner_id=runner_id, node_id=self.node_id)  # all layers

    async def _send_lifecycle(self, runner_id: RunnerId, phase: LocalPhase, request: Request) -> None:
        runner = self._runners.get(runner_id)
        if runner is None or runner.phase == "stopping" or not self._set_phase(runner_id, phase):
            return  # it failed or is being stopped since this step was planned: the next plan decides
        await self._publish_status(runner_id, phase)  # type: ignore[arg-type]
        await self._hosts[runner_id].send(request)

    async def _forward(self, step: ForwardTask) -> None:
        runner = self._runners[step.runner_id]
        self._runners[step.runner_id] = replace(runner, forwarded=runner.forwarded | {step.task_id})
        task = self._view.state.tasks[step.task_id]
        card = find_card(self._view.state, self._builtin_cards, task.model_id)
        defaults = card.sampling_for(task.params.enable_thinking) if card else SamplingDefaults()
        images = {d: str(self._images.cache.path(d)) for d in images_of(task)}
        self._images.cache.touch(images)
        resume = await self._resume_of(task)
        self._runs.forwarded(step.runner_id, task.task_id, len(task.migrations))
        log.info("worker: task %s forwarded to runner %s%s", task.task_id, step.runner_id,
                 f" (run {resume.attempt}, after {len(resume.token_ids)} streamed tokens)" if resume else "")
        await self._hosts[step.runner_id].send(
            Generate(task_id=task.task_id, params=task.params, defaults=defaults, image_paths=images, resume=resume)
        )

    async def _resume_of(self, task: Task) -> Resume | None:
        """A migrated task continues after the tokens its earlier runs streamed (EXO_TOKENS)."""
        if not task.migrations:
            return None
        token_ids, next_index = await resume_point(self._nc, task.task_id, len(task.migrations))
        return Resume(token_ids=token_ids, next_index=next_index, attempt=len(task.migrations))

    async def _on_report(self, runner_id: RunnerId, report: AnyReport) -> None:
        if runner_id in self._runners:
            self._runners[runner_id] = replace(self._runners[runner_id], heard_at=time.monotonic())
        match report:
            case Loaded():
                self._set_phase(runner_id, "loaded")
            case WarmedUp():
                self._set_phase(runner_id, "ready", failures=0)
                await self._publish_status(runner_id, "ready")
            case Started():
                await self._publish(TaskStarted(task_id=report.task_id,
                                                attempt=self._runs.run_given(runner_id, report.task_id)))
            case Done():
                run = self._runs.finished(runner_id, report.task_id)
                self._note_prompt_cache(runner_id, report.prompt_cache)
                statuses: dict[str, TaskStatus] = {"error": "failed", "cancelled": "cancelled"}
                status = statuses.get(report.finish_reason, "completed")
                await self._publish(TaskFinished(
                    task_id=report.task_id, status=status, finish_reason=report.finish_reason, error=report.error,
                    prompt_tokens=report.prompt_tokens, completion_tokens=report.completion_tokens,
                    cached_tokens=report.cached_tokens, attempt=run,
                ))
            case Failed():
                await self._fail_runner(runner_id, report.error)

    def _note_prompt_cache(self, runner_id: RunnerId, stats: PromptCacheStats | None) -> None:
        runner = self._runners.get(runner_id)
        if stats is not None and runner is not None:
            self._prompt_cache_stats[runner.instance_id] = stats

    def prompt_caches(self) -> dict[InstanceId, PromptCacheStats]:
        """The latest prompt-cache figures of each runner this node has (for its heartbeat)."""
        live = {runner.instance_id for runner in self._runners.values()}
        return {i: stats for i, stats in self._prompt_cache_stats.items() if i in live}

    async def _on_runner_exit(self, runner_id: RunnerId, code: int, log_tail: str) -> None:
        await self._fail_runner(runner_id, f"runner exited with code {code}: {log_tail}")

    async def _fail_runner(self, runner_id: RunnerId, error: str, restartable: bool = True) -> None:
        runner = self._runners.get(runner_id)
        if runner is None or runner.phase in ("failed", "stopping"):
            return
        self._set_phase(runner_id, "failed", error=error, failures=runner.failures + 1, failed_at=time.monotonic(),
                        restartable=restartable)
        await self._publish_status(runner_id, "failed", error)
        self._wake_after(restart_due(self._runners[runner_id]) - time.monotonic())
        self._wake_after(self._migrate_grace_s)  # its tasks, if held for the master to move (plan.py), end then

    def _wake_after(self, delay: float) -> None:
        asyncio.get_running_loop().call_later(max(delay, 0.0) + 0.01, self._wake.set)

    async def _abandon_runner(self, step: AbandonRunner) -> None:
        """A peer rank failed: stop ours too (not our failure) and rejoin when the peer is back."""
        log.warning("worker: runner %s stops: %s", step.runner_id, step.reason)
        host = self._hosts.get(step.runner_id)
        if host is not None:
            host.kill()
        self._set_phase(step.runner_id, "failed", error=step.reason, failed_at=time.monotonic())
        await self._publish_status(step.runner_id, "stopped", step.reason)
        self._wake_after(restart_due(self._runners[step.runner_id]) - time.monotonic())
        self._wake_after(self._migrate_grace_s)

    async def _restart_runner(self, step: RestartRunner) -> None:
        failures, failed_at = self._runners[step.runner_id].failures, self._runners[step.runner_id].failed_at
        log.warning("worker: restarting runner %s (failures so far: %d)", step.runner_id, failures)
        host = self._hosts.pop(step.runner_id, None)
        if host is not None:
            host.kill()
        self._model_paths.pop(step.runner_id, None)
        await self._create_runner(step, failures, failed_at)

    def _instance_of(self, runner_id: RunnerId) -> Instance | None:
        runner = self._view.state.runners.get(runner_id)
        return self._view.state.instances.get(runner.instance_id) if runner else None

    def _rank_setup(self, runner_id: RunnerId) -> RankSetup | None:
        """Where this runner sits in its instance's ring group; None for a one-node instance."""
        instance = self._instance_of(runner_id)
        if instance is None or len(instance.shards) < 2:
            return None
        shards = sorted(instance.shards, key=lambda s: s.rank)
        mine = next(s for s in shards if s.runner_id == runner_id)
        return RankSetup(rank=mine.rank, ring_hosts=[s.ring_address for s in shards], sharding=instance.sharding,
                            start_layer=mine.start_layer, end_layer=mine.end_layer)

    async def _end_task(self, task_id: TaskId, status: TaskStatus, reason: str) -> None:
        self._runs.ended(self._view.state, task_id)
        finish: FinishReason = "cancelled" if status == "cancelled" else "error"
        attempt = run_of(self._view.state, task_id)
        await publish_chunk(self._nc, TokenChunk(command_id=task_id, index=0, finish_reason=finish, error=reason,
                                                 attempt=attempt))
        await self._publish(TaskFinished(task_id=task_id, status=status, finish_reason=finish, error=reason,
                                         attempt=attempt))

    async def _stop_runner(self, runner_id: RunnerId, graceful: bool = True) -> None:
        host = self._hosts.pop(runner_id, None)
        runner = self._runners.get(runner_id)
        if host is not None and runner is not None and graceful:
            for task_id in runner.forwarded - self._runs.ended_ids():  # stop a generation in progress first
                await host.send(Cancel(task_id=task_id))
        if host is not None:
            await host.stop(timeout=5.0 if graceful else 0.0)
        self._runners.pop(runner_id, None)
        self._model_paths.pop(runner_id, None)
        self._wake.set()  # a group waiting for this node's stopping runner to leave may form now (plan.py)
