"""The worker: keeps State, asks `plan` what to do for the runners bound to this node, does it.

Local facts (which runner processes exist and how far each got) live in `Runners`
(exo/worker/runners.py); everything other nodes need to know is published as an event. This
module is the loop: it plans on every relevant event and hands each step to the code that
does it: runner steps to `Runners`, task and image steps here.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any

from exo.background import Background
from exo.bus.chunk_gate import ChunkGate
from exo.bus.chunk_signing import ChunkSigner
from exo.bus.connection import Connection
from exo.bus.errors import raise_if_cancelled
from exo.bus.event_log import EventLog
from exo.bus.state_view import FoldedView
from exo.bus.subjects import SHARED, LogNames
from exo.bus.token_stream import publish_chunk, resume_point
from exo.core.catalogue import adapter_of, find_card
from exo.core.events import AnyEvent, CustomCardAdded, CustomCardDeleted, Event, TaskCreated, TaskFinished, TaskStarted
from exo.core.ids import InstanceId, ModelId, NodeId, TaskId
from exo.core.requests import FinishReason, TokenChunk
from exo.core.state import State
from exo.core.types import ModelCard, PromptCacheStats, SamplingDefaults, ShardAssignment, Task, TaskStatus
from exo.models.cards import reconcile_custom_card, reconcile_custom_cards
from exo.models.dirs import DownloadSettings
from exo.models.transfer import DownloadError
from exo.runner.protocol import Generate, Resume, RunnerStart
from exo.settings.services import MasterSettings, ModelSettings, WorkerSettings
from exo.telemetry import tracing
from exo.worker.adapter_files import AdapterFiles
from exo.worker.cache_reports import CacheReporter
from exo.worker.downloads import DownloadCoordinator
from exo.worker.forward_journal import ForwardJournal
from exo.worker.plan import (
    AbandonRunner,
    CancelForwardedTask,
    CreateRunner,
    DownloadModel,
    EndTask,
    ExpectPrefillTask,
    FetchImages,
    ForwardTask,
    KillHungRunner,
    LoadModel,
    RestartRunner,
    Step,
    StopRunner,
    WarmUpRunner,
    WorkerView,
    busy,
    images_needed,
    images_of,
    images_of_waiting_tasks,
    images_to_fetch,
    nodes_concerned,
    plan,
    tasks_needing,
)
from exo.worker.prefill_peers import prefill_peer_of
from exo.worker.runner_host import RunnerFactory, RunnerHost
from exo.worker.runners import Runners, wake_after
from exo.worker.task_images import TaskImages
from exo.worker.task_runs import TaskRuns, run_of

log = logging.getLogger(__name__)

# A multi-node instance's failed runner may have lost a peer machine: its tasks wait for the master
# to suspect that machine (EXO_SUSPECT_S) and move them, this much longer, before this node ends
# them with the error.
MIGRATE_MARGIN_S = 3.0


class Worker:
    def __init__(
        self, nc: Connection, view: FoldedView, node_id: NodeId, data_dir: Path,
        nats_urls: list[str], builtin_cards: Mapping[ModelId, ModelCard], download_settings: DownloadSettings | None = None,
        runner_factory: RunnerFactory | None = None, *, settings: WorkerSettings = WorkerSettings(),
        runner_start: RunnerStart | None = None, suspect_s: float = MasterSettings().suspect_s,
    ) -> None:
        self.node_id = node_id
        self._nc = nc
        self._view = view
        self._logs: dict[LogNames, EventLog] = {}  # by log: a task's events go to the log that holds it
        self._data_dir = data_dir
        self._builtin_cards = builtin_cards
        # A runner that has work and shows no progress for settings.runner_stall_s (no Alive report: its
        # model thread is stuck, or the process is stopped) is hung.
        self._settings = settings
        self._migrate_grace_s = suspect_s + MIGRATE_MARGIN_S
        downloads = download_settings or DownloadSettings.of(ModelSettings(), data_dir)
        start = runner_start or RunnerStart(nats_urls=nats_urls)
        # The last chunk this worker sends for its runner is signed as its runners' are.
        self._signer = ChunkSigner.from_file(start.node_id, Path(start.node_key_file)) if start.node_key_file else None
        self._chunk_gate = ChunkGate(lambda: view.state)  # earlier runs' chunks count for a resume only if theirs
        self._batch_slots = start.settings.max_batch  # the queue stays here, fair between keys (fairness.py)
        new_runner = runner_factory or (
            lambda runner_id: RunnerHost(runner_id, start, data_dir / "logs", offline=downloads.offline))
        self._runs = TaskRuns()  # which run of each task this node forwarded and ended
        self._journal = ForwardJournal(data_dir / "worker" / "forwarded")  # what its runners were given, for a restart
        self._given_before_restart: dict[TaskId, int] = {}
        self._traces: dict[TaskId, str] = {}  # open traced tasks -> their task.created's delivery span (traceparent)
        self._wake = asyncio.Event()
        self._cache_reports = CacheReporter(nc, node_id, lambda: self._view.state)  # for the masters' routing
        self._runners = Runners(
            node_id=node_id, state=lambda: self._view.state, new_runner=new_runner, publish=self._publish,
            runs=self._runs, fetch_model=self._model_files, wake=self._wake, migrate_grace_s=self._migrate_grace_s,
            fetch_adapter=self._adapter_folder, on_cache_held=self._cache_reports.on_cache_held)
        self._adapters = AdapterFiles(nc, data_dir / "adapters", settings.adapter_cache_bytes, self._adapters_in_use)
        self._images = TaskImages(
            nc=nc, images_dir=self.images_dir, fail_tasks_needing=self._fail_tasks_needing,
            needed=lambda: images_needed(self._worker_view()), limit_bytes=settings.image_cache_bytes)
        self._background = Background("worker")
        self.downloads = DownloadCoordinator(
            nc=nc, node_id=node_id, settings=downloads, publish=self._publish, state=lambda: self._view.state,
            card_of=lambda model_id: find_card(self._view.state, builtin_cards, model_id),
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
        # tasks need, and those of tasks waiting for a lost instance's replacement, which may be
        # placed here); only then does it plan anything.
        reconcile_custom_cards(self.custom_cards_dir, self._view.state.custom_model_cards)
        self._given_before_restart = self._still_open(self._journal.load())
        self._journal.compact(self._given_before_restart)
        await self.downloads.start()
        await self._fetch_images(images_to_fetch(self._worker_view()))
        await self._images.fetch_while_room(images_of_waiting_tasks(self._worker_view()))
        self._images.trim()
        log.info("worker: disk reconciled with State at sequence %d; planning starts", self._view.state.last_seq)
        self._in_background(self._watch_busy_runners())
        self._in_background(self._cache_reports.run())
        self._wake.set()
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._runners.forget_tasks(self._runs.forget_settled(self._view.state))
            self._images.trim()
            for step in plan(self._worker_view()):
                try:
                    await self._execute(step)
                except Exception:  # one failed step must not stop the worker; the next plan retries
                    raise_if_cancelled()
                    log.exception("step %s failed", step)
                    wake_after(self._wake, 1.0)  # soon, whether or not an event about this node comes

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
        await self._runners.stop_all()

    def kill_runners(self) -> None:
        self._runners.kill_all()

    def prompt_caches(self) -> dict[InstanceId, PromptCacheStats]:
        """The latest prompt-cache figures of each runner this node has (for its heartbeat)."""
        return self._runners.prompt_caches()

    def _worker_view(self) -> WorkerView:
        return WorkerView(
            node_id=self.node_id, state=self._view.state, runners=self._runners.records(),
            ended_tasks=self._runs.current_ends(self._view.state),
            local_images=self._images.cache.digests(), images_in_flight=frozenset(self._images.in_flight),
            now=time.monotonic(), stall_after=self._settings.runner_stall_s, migrate_grace=self._migrate_grace_s,
            batch_slots=self._batch_slots, given_before_restart=self._given_before_restart,
        )

    def _on_event(self, seq: int, event: AnyEvent, state: State) -> None:
        # One card event touches one file (a whole-folder reconcile per event fell behind the log:
        # docs/reliability.md). State, not the event, says what the file must be: the reducer may
        # have skipped the event.
        if isinstance(event, (CustomCardAdded, CustomCardDeleted)):
            model_id = event.card.model_id if isinstance(event, CustomCardAdded) else event.model_id
            reconcile_custom_card(self.custom_cards_dir, model_id, state.custom_model_cards.get(model_id))
        if isinstance(event, TaskCreated) and (trace := tracing.current_traceparent()):
            self._traces[event.task.task_id] = trace  # its delivery here (event_log.py): where forwarding it goes on
        elif isinstance(event, TaskFinished):
            self._traces.pop(event.task_id, None)
        concerned = nodes_concerned(state, event)
        if concerned is None or self.node_id in concerned:
            self._wake.set()

    async def _publish(self, event: Event) -> None:
        names = self._view.names_for_task(event.task_id) if isinstance(event, (TaskStarted, TaskFinished)) else SHARED
        if (events := self._logs.get(names)) is None:
            events = self._logs[names] = EventLog(self._nc, names, self._signer)
        await events.append(event, event_id=uuid.uuid4().hex)

    def _in_background(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        self._background.start(coroutine)

    async def _execute(self, step: Step) -> None:
        log.debug("step %s", step)
        match step:
            case CreateRunner():
                await self._runners.create(step)
            case DownloadModel():
                self._runners.download(step)
            case LoadModel():
                await self._runners.load(step.runner_id)
            case WarmUpRunner():
                await self._runners.warm_up(step.runner_id)
            case RestartRunner():
                await self._runners.restart(step)
            case AbandonRunner():
                await self._runners.abandon(step)
            case KillHungRunner():
                await self._runners.kill_hung(step)
            case StopRunner():
                self._runners.stop(step.runner_id)
            case ForwardTask():
                await self._forward(step)
            case CancelForwardedTask():
                await self._runners.cancel(step.runner_id, step.task_id)
            case ExpectPrefillTask():
                await self._runners.expect_prefill(step.runner_id, step.task_id)
            case EndTask():
                await self._end_task(step.task_id, step.status, step.reason)
            case FetchImages():
                self._start_fetching(step.digests)

    async def _model_files(self, model_id: ModelId, shard: ShardAssignment) -> Path:
        card = find_card(self._view.state, self._builtin_cards, model_id)
        if card is None:
            raise DownloadError("not_found", f"no model card for {model_id}")
        return await self.downloads.ensure(card, shard.start_layer, shard.end_layer)

    async def _adapter_folder(self, model_id: ModelId) -> Path | None:
        """The folder of the adapter "<base>:<adapter>" names, fetched if need be (None: a plain model)."""
        adapter = adapter_of(self._view.state, model_id)
        return None if adapter is None else await self._adapters.folder_for(adapter)

    def _adapters_in_use(self) -> set[str]:
        state = self._view.state
        mine = (i for i in state.instances.values() if any(s.node_id == self.node_id for s in i.shards))
        rows = (t.model_id for i in mine for t in state.open_tasks_of(i.instance_id) if t.model_id != i.model_id)
        return {adapter.digest for model_id in (*(i.model_id for i in mine), *rows)
                if (adapter := adapter_of(state, model_id)) is not None}

    def _start_fetching(self, digests: list[str]) -> None:
        self._images.in_flight.update(digests)  # now: the next plan must not fetch them again
        self._in_background(self._fetch_images(digests))

    async def _fetch_images(self, digests: list[str]) -> None:
        await self._images.fetch(digests)
        self._wake.set()

    def _fail_tasks_needing(self, digest: str, reason: str) -> None:
        for task_id in tasks_needing(self._worker_view(), digest):
            self._runs.ended(self._view.state, task_id)  # now, not when _end_task runs: the next plan must not fetch it again
            self._in_background(self._end_task(task_id, "failed", reason))

    def _still_open(self, given: Mapping[TaskId, int]) -> dict[TaskId, int]:
        """The runs given whose task is still open on that run (not ended, not moved on since)."""
        state = self._view.state
        return {t: run for t, run in given.items() if (task := state.tasks.get(t)) is not None
                and task.status in ("pending", "running") and len(task.migrations) == run}

    async def _forward(self, step: ForwardTask) -> None:
        task = self._view.state.tasks[step.task_id]
        try:
            adapter_path = await self._row_adapter(task)
        except Exception as error:  # a missing or corrupt object: this request fails, the instance serves on
            await self._end_task(task.task_id, "failed", f"cannot load the adapter of {task.model_id}: {error}")
            return
        self._runners.note_forwarded(step.runner_id, step.task_id)
        if self._journal.due_for_compaction():
            in_runners = {t: run_of(self._view.state, t) for r in self._runners.records().values() for t in r.forwarded}
            self._journal.compact(self._still_open(in_runners))
        if not self._journal.note(task.task_id, len(task.migrations)):  # a full disk: State must say it began, as before
            await self._publish(TaskStarted(task_id=task.task_id, attempt=len(task.migrations)))
        card = find_card(self._view.state, self._builtin_cards, task.model_id)
        defaults = card.sampling_for(task.params.enable_thinking) if card else SamplingDefaults()
        images = {d: str(self._images.cache.path(d)) for d in images_of(task)}
        self._images.cache.touch(images)
        resume = await self._resume_of(task)
        self._runs.forwarded(step.runner_id, task.task_id, len(task.migrations))
        log.debug("worker: task %s forwarded to runner %s%s", task.task_id, step.runner_id,
                 f" (run {resume.attempt}, after {len(resume.token_ids)} streamed tokens)" if resume else "")
        with tracing.span("exo.worker.forward", self._traces.get(task.task_id, ""), "producer",
                          {"exo.task_id": task.task_id, "exo.attempt": len(task.migrations)}) as forwarding:
            await self._runners.send(step.runner_id, Generate(
                task_id=task.task_id, params=task.params, defaults=defaults, image_paths=images, resume=resume,
                traceparent=forwarding.traceparent, adapter_path=adapter_path,
                prefill=prefill_peer_of(self._view.state, task) if not adapter_path else None))

    async def _row_adapter(self, task: Task) -> str:
        """The folder of the adapter a task names when it runs on its base's instance
        (EXO_ADAPTERS_SHARE_BASE): fetched by hash as for an instance of its own. "": none."""
        instance = self._view.state.instances.get(task.instance_id)
        if instance is None or instance.model_id == task.model_id:
            return ""
        folder = await self._adapter_folder(task.model_id)
        if folder is None:  # never the bare base's text for a request that named an adapter
            raise LookupError("no such adapter (deleted?)")
        return str(folder)

    async def _resume_of(self, task: Task) -> Resume | None:
        """A migrated task continues after the tokens its earlier runs streamed (EXO_TOKENS)."""
        if not task.migrations:
            return None
        token_ids, next_index = await resume_point(self._nc, task.task_id, len(task.migrations), gate=self._chunk_gate)
        return Resume(token_ids=token_ids, next_index=next_index, attempt=len(task.migrations))

    async def _end_task(self, task_id: TaskId, status: TaskStatus, reason: str) -> None:
        self._runs.ended(self._view.state, task_id)
        finish: FinishReason = "cancelled" if status == "cancelled" else "error"
        attempt = run_of(self._view.state, task_id)
        await publish_chunk(self._nc, TokenChunk(command_id=task_id, index=0, finish_reason=finish, error=reason,
                                                 attempt=attempt), self._signer)
        await self._publish(TaskFinished(task_id=task_id, status=status, finish_reason=finish, error=reason,
                                         attempt=attempt, at=time.time()))
