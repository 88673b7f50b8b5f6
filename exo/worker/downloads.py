"""This node's download coordinator: one download per model at a time, whoever asks for it (the
worker's plan through `ensure`, or a person through the API's start / cancel / delete, which
reach it over exo/bus/download_control), progress and failures published as events, and this
node's complete models served to peers (exo/bus/model_share).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exo.background import Background
from exo.bus.connection import Connection
from exo.bus.peers.download_control import Action, DownloadControlServer, DownloadReply
from exo.bus.peers.model_share import IN_FLIGHT, ModelShareServer
from exo.core.events import DownloadDeleted, DownloadFailed, DownloadProgressed, Event
from exo.core.ids import ModelId, NodeId
from exo.core.state import State
from exo.core.types import DownloadProgress, DownloadStatus, FileProgress, ModelCard
from exo.models.dirs import MANIFEST_FILE, DownloadSettings, LocalCopy, delete_copies, find_complete, read_manifest
from exo.models.files import Manifest
from exo.models.progress import summarize
from exo.models.transfer import DownloadCancelled, DownloadError
from exo.worker.model_fetch import ModelFetch

log = logging.getLogger(__name__)

_POLL_S = 0.25  # how often the reporter looks; it publishes at most once per progress interval
_SAMPLES_KEPT_S = 10.0


def peers_with(state: State, model_id: ModelId, me: NodeId) -> list[NodeId]:
    """Other nodes whose copy of the model is complete, in a stable order."""
    return sorted(n for n, models in state.downloads.items()
                  if n != me and (d := models.get(model_id)) is not None and d.status == "completed")


@dataclass
class _Job:
    fetch: ModelFetch
    task: asyncio.Task[Path] | None = None
    samples: list[tuple[float, int]] = field(default_factory=list)
    last_sent: float = 0.0
    last_done: int = -1
    cancelled_on_request: bool = False


class DownloadCoordinator:
    def __init__(
        self, *, nc: Connection, node_id: NodeId, settings: DownloadSettings, publish: Callable[[Event], Awaitable[None]],
        state: Callable[[], State], card_of: Callable[[ModelId], ModelCard | None], clock: Callable[[], float] = time.time,
    ) -> None:
        self.node_id = node_id
        self.settings = settings
        self._nc = nc
        self._publish = publish
        self._state = state
        self._card_of = card_of
        self._clock = clock
        self._jobs: dict[ModelId, _Job] = {}
        self._locks: defaultdict[ModelId, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._share_cache: dict[Path, tuple[int, Manifest]] = {}
        self._peer_slots = asyncio.Semaphore(IN_FLIGHT)
        self._servers: list[DownloadControlServer | ModelShareServer] = [DownloadControlServer(nc, node_id, self.handle)]
        if settings.share and not settings.offline:
            self._servers.append(ModelShareServer(nc, node_id, self._shareable))
        self._reporter: asyncio.Task[None] | None = None
        self._background = Background("downloads")
        self._terminal = sys.stderr.isatty()

    async def start(self) -> None:
        for server in self._servers:
            await server.start()
        self._reporter = asyncio.create_task(self._report_loop(), name="download-progress")

    async def stop(self) -> None:
        for job in self._jobs.values():
            job.fetch.cancelled.set()  # threads stop at their next chunk; partial files stay
        running = [j.task for j in self._jobs.values() if j.task is not None]
        if running:
            await asyncio.wait(running, timeout=10)
        self._background.cancel_all()
        if self._reporter is not None:
            self._reporter.cancel()
        for server in self._servers:
            await server.stop()

    async def ensure(self, card: ModelCard, start: int = 0, end: int = 0) -> Path:
        """The directory holding what layers [start, end) of `card` need (end <= start: all),
        downloading what is missing. Raises DownloadError or DownloadCancelled."""
        if card.path:
            if not (Path(card.path) / "config.json").is_file():
                raise DownloadError("not_found", f"{card.model_id}: no config.json in local model directory {card.path}")
            return Path(card.path)
        async with self._locks[card.model_id]:
            running = self._jobs.get(card.model_id)
            if running is not None:
                await asyncio.wait([running.task])  # type: ignore[type-var]  # launched: set
                if running.cancelled_on_request:
                    raise DownloadCancelled(f"the download of {card.model_id} was cancelled")
            copy = await asyncio.to_thread(find_complete, self.settings.dirs, card, start, end)
            if copy is not None:
                await self._report_local(card, copy)
                return copy.path
            job = self._launch(card, start, end)
        assert job.task is not None
        return await asyncio.shield(job.task)

    async def handle(self, action: Action, model_id: ModelId) -> DownloadReply:
        """A request from the API (exo/bus/download_control)."""
        if action == "delete":
            return await self._delete(model_id)
        job = self._jobs.get(model_id)
        if action == "cancel":
            if job is None:
                return DownloadReply(ok=False, code="not_found",
                                     message=f"no download of {model_id} is running on {self.node_id}")
            job.cancelled_on_request = True
            job.fetch.cancelled.set()
            return DownloadReply(ok=True, message=f"download of {model_id} cancelled")
        card = self._card_of(model_id)
        if card is None:
            return DownloadReply(ok=False, code="not_found", message=f"unknown model {model_id!r}")
        # A running download may be one shard's files: once it ends, this fetches the rest.
        self._in_background(self._ensure_quietly(card))
        return DownloadReply(ok=True, message=f"{model_id} is already downloading" if job else f"download of {model_id} started")

    async def _ensure_quietly(self, card: ModelCard) -> None:
        with contextlib.suppress(DownloadError, DownloadCancelled):  # already published as an event
            await self.ensure(card)

    def _launch(self, card: ModelCard, start: int, end: int) -> _Job:
        peers = lambda: peers_with(self._state(), card.model_id, self.node_id)  # noqa: E731
        job = _Job(fetch=ModelFetch(self._nc, card, start, end, self.settings, peers, self._peer_slots))
        job.task = asyncio.create_task(self._run(job), name=f"download {card.model_id}")
        self._jobs[card.model_id] = job
        return job

    async def _run(self, job: _Job) -> Path:
        model_id, started = job.fetch.card.model_id, self._clock()
        log.info("download: %s started", model_id, extra={"model": model_id})
        try:
            path = await job.fetch.run()
            await self._publish_progress(job, "completed")
            log.info("download: %s complete in %s: %.2f GB in %.0f s (from %s)", model_id, path, job.last_done / 1e9,
                     self._clock() - started, job.fetch.source, extra={"model": model_id})
            return path
        except DownloadCancelled:
            await self._publish_progress(job, "cancelled")
            raise
        except DownloadError as error:
            log.error("download: %s failed: %s", model_id, error.reason)
            await self._publish(DownloadFailed(node_id=self.node_id, model_id=model_id, code=error.code,
                                               reason=error.reason, at=self._clock()))
            raise
        except Exception as error:
            log.exception("download: %s failed", model_id)
            reason = f"{type(error).__name__}: {error}"
            await self._publish(DownloadFailed(node_id=self.node_id, model_id=model_id, code="unknown",
                                               reason=reason, at=self._clock()))
            raise DownloadError("unknown", reason) from error
        finally:
            self._jobs.pop(model_id, None)
            self._share_cache.clear()

    async def _delete(self, model_id: ModelId) -> DownloadReply:
        job = self._jobs.get(model_id)
        if job is not None:
            job.cancelled_on_request = True
            job.fetch.cancelled.set()
            await asyncio.wait([job.task])  # type: ignore[type-var]  # launched: set
        async with self._locks[model_id]:
            removed = await asyncio.to_thread(delete_copies, self.settings.dirs, model_id)
            self._share_cache.clear()
            if self._state().download_of(self.node_id, model_id) is not None:
                await self._publish(DownloadDeleted(node_id=self.node_id, model_id=model_id))
            elif not removed:
                return DownloadReply(ok=False, code="not_found", message=f"{model_id} is not downloaded on {self.node_id}")
        return DownloadReply(ok=True, message=f"deleted {model_id} from {', '.join(map(str, removed)) or 'nowhere'}")

    async def _report_local(self, card: ModelCard, copy: LocalCopy) -> None:
        known = self._state().download_of(self.node_id, card.model_id)
        if known is not None and known.status == "completed" and known.path == str(copy.path):
            return  # nothing new to say (a restart, another runner of the same model)
        total = sum(copy.files.values())
        await self._publish(DownloadProgressed(progress=DownloadProgress(
            node_id=self.node_id, model_id=card.model_id, status="completed", done_bytes=total, total_bytes=total,
            eta_s=0.0, files=[FileProgress(path=p, done=s, total=s) for p, s in sorted(copy.files.items())],
            source="local", path=str(copy.path), updated_at=self._clock(),
        )))

    def _progress(self, job: _Job, status: DownloadStatus, now: float) -> DownloadProgress:
        fetch = job.fetch
        return summarize(self.node_id, fetch.card.model_id, status, fetch.done_of(), job.samples, now,
                         source=fetch.source, path=str(fetch.target or ""))

    async def _publish_progress(self, job: _Job, status: DownloadStatus) -> None:
        progress = self._progress(job, status, self._clock())
        job.last_sent, job.last_done = progress.updated_at, progress.done_bytes
        await self._publish(DownloadProgressed(progress=progress))
        if self._terminal and job.samples:  # a progress line was drawn: finish it
            _draw(progress)
            sys.stderr.write(f" {status}\n")

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(_POLL_S)
            for job in list(self._jobs.values()):
                try:
                    await self._report(job)
                except Exception:  # a failed publish must not stop the reporting of the others
                    log.exception("download: cannot report progress of %s", job.fetch.card.model_id)

    async def _report(self, job: _Job) -> None:
        if not job.fetch.started or job.task is None or job.task.done():
            return
        now = self._clock()
        done = sum(d for d, _ in job.fetch.done_of().values())
        job.samples = [s for s in job.samples if s[0] >= now - _SAMPLES_KEPT_S] + [(now, done)]
        if now - job.last_sent >= self.settings.progress_interval_s and done != job.last_done:
            progress = self._progress(job, "downloading", now)
            job.last_sent, job.last_done = now, done
            await self._publish(DownloadProgressed(progress=progress))
            if self._terminal:
                _draw(progress)

    async def _shareable(self, model_id: ModelId) -> tuple[Path, Manifest] | None:
        """A directory of this node holding verified files of the model, and its manifest."""
        for path in self.settings.dirs.writable_copies(model_id):
            try:
                stamp = (path / MANIFEST_FILE).stat().st_mtime_ns
            except OSError:
                continue
            cached = self._share_cache.get(path)
            if cached is None or cached[0] != stamp:
                manifest = await asyncio.to_thread(read_manifest, path)
                if manifest is None:
                    continue
                cached = self._share_cache[path] = (stamp, manifest)
            if cached[1].verified:
                return path, cached[1]
        return None

    def _in_background(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        self._background.start(coroutine)


def _draw(progress: DownloadProgress) -> None:
    """One line per model on a terminal, redrawn in place."""
    percent = 100 * progress.done_bytes / progress.total_bytes if progress.total_bytes else 0
    eta = f"{progress.eta_s:.0f} s" if progress.eta_s is not None else "?"
    sys.stderr.write(f"\r{progress.model_id}: {percent:5.1f}% {progress.done_bytes / 1e6:.0f}/"
                     f"{progress.total_bytes / 1e6:.0f} MB {progress.speed_bps / 1e6:.1f} MB/s eta {eta}\x1b[K")
    sys.stderr.flush()
