"""The worker's side of one runner subprocess: spawn it, send requests, hear its reports."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import BinaryIO, Protocol

import msgspec

from exo.core.ids import RunnerId
from exo.runner.protocol import RUNNER_START_ENV, AnyReport, Request, RunnerStart, Shutdown, encode_line, report_decoder
from exo.worker.child_process import ChildProcess, spawn

log = logging.getLogger(__name__)

OnReport = Callable[[AnyReport], Awaitable[None]]
OnExit = Callable[[int, str], Awaitable[None]]


class RunnerLink(Protocol):
    """What the worker needs of a runner: a subprocess here; the scale simulator's fake runner
    (tests/support/fake_runner.py) is the other implementation."""

    runner_id: RunnerId

    async def start(self, on_report: OnReport, on_exit: OnExit) -> None: ...

    async def send(self, request: Request) -> None: ...

    async def stop(self, timeout: float = 5.0) -> None: ...

    def kill(self) -> None: ...


RunnerFactory = Callable[[RunnerId], RunnerLink]


class RunnerHost:
    def __init__(self, runner_id: RunnerId, start: RunnerStart, log_dir: Path, offline: bool = False) -> None:
        self.runner_id = runner_id
        self._start = start
        self._offline = offline
        self._log_path = log_dir / f"runner-{runner_id}.log"
        self._process: ChildProcess | None = None
        self._reader: asyncio.Task[None] | None = None
        self._stopping = False
        self._log_start = 0  # where this process's part of the (appended) log file begins

    async def start(self, on_report: OnReport, on_exit: OnExit) -> None:
        env = {**os.environ, RUNNER_START_ENV: msgspec.json.encode(self._start).decode()}
        if self._offline:  # huggingface-hub in the runner must not reach the network either
            env["HF_HUB_OFFLINE"] = "1"
        with await asyncio.to_thread(self._open_log) as log:  # a slow disk must not hold up the event loop
            self._process = await spawn([sys.executable, "-m", "exo.runner"], env, log)
        self._reader = asyncio.create_task(self._read(on_report, on_exit))

    def _open_log(self) -> BinaryIO:
        """The log file, opened for appending; notes where this process's part of it begins."""
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_start = self._log_path.stat().st_size if self._log_path.exists() else 0
        return open(self._log_path, "ab")

    async def send(self, request: Request) -> None:
        assert self._process is not None and self._process.stdin is not None
        self._process.stdin.write(encode_line(request))
        await self._process.stdin.drain()

    async def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        process = self._process
        if process is None or process.returncode is not None:
            return
        try:
            if timeout <= 0:
                raise TimeoutError  # no graceful stop asked for
            await asyncio.wait_for(self.send(Shutdown()), timeout)
            await asyncio.wait_for(process.wait(), timeout)
        except (TimeoutError, ConnectionError, BrokenPipeError):
            if timeout > 0:
                log.warning("runner %s did not stop within %.0f s (stuck in a collective whose peer is gone?): "
                            "killed", self.runner_id, timeout)
            process.kill()
            try:
                await asyncio.wait_for(process.wait(), max(timeout, 5.0))
            except TimeoutError:
                log.error("runner %s (pid %d) killed, but has not exited after %.0f s; going on",
                          self.runner_id, process.pid, max(timeout, 5.0))

    def kill(self) -> None:
        self._stopping = True
        if self._process is not None and self._process.returncode is None:
            self._process.kill()

    async def _read(self, on_report: OnReport, on_exit: OnExit) -> None:
        assert self._process is not None and self._process.stdout is not None
        async for line in self._process.stdout:
            try:
                await on_report(report_decoder.decode(line))
            except Exception:  # one report we could not act on must not stop us hearing the rest
                log.exception("runner %s: report not handled: %r", self.runner_id, line[:200])
        code = await self._process.wait()
        if not self._stopping:
            await on_exit(code, await asyncio.to_thread(self._log_tail))

    def _log_tail(self, lines: int = 5) -> str:
        """The end of what this process wrote: an earlier run's traceback is not its cause."""
        try:
            with open(self._log_path, "rb") as log_file:
                log_file.seek(self._log_start)
                text = log_file.read().decode(errors="replace")
        except OSError:
            return ""
        return " | ".join(text.strip().splitlines()[-lines:])
