"""The tasks this node gave its runners, kept on this node's disk.

A worker that restarts (its runners die with it) must not run a task a second time that a runner of
its earlier life had begun: the client would get two generations spliced into one stream. It used
to learn that from State (every task's `task.started` event, one per request, folded by every node);
it now reads this file instead, and fails those tasks as before ("its runner restarted
mid-generation"). The log hears `task.started` only of a task that is still running a second after
it started (runners.py), for operators and the dashboard.

One line per task given, "<task id> <run>" (the run: its number of migrations then), appended as it
is forwarded (no fsync: the file must outlive the process, not the machine; a machine that went
down took its runners with it, and the master moves its tasks). Only that run was begun here: a
task moved since (a later run, perhaps back to this node) is not. Read strictly: a line that is no
task id and run is ignored. A write that fails (a full disk) is reported to the caller, which then
appends `task.started` at once, as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from exo.core.ids import TaskId

log = logging.getLogger(__name__)

MAX_ID_CHARS = 200
MAX_READ_BYTES = 64 << 20  # more is not a journal this code wrote: read no further
COMPACT_AT = 10_000  # lines: rewritten then with the tasks still in progress only


class ForwardJournal:
    def __init__(self, path: Path) -> None:
        self._path = path
        self._file: IO[str] | None = None
        self._lines = 0

    def load(self) -> dict[TaskId, int]:
        """Each task the file holds (written by this node's earlier life), with the latest run given."""
        try:
            with self._path.open("rb") as file:
                data = file.read(MAX_READ_BYTES)
        except FileNotFoundError:
            return {}
        except OSError as error:
            log.warning("worker: cannot read %s (%s): a task begun before a restart may run again", self._path, error)
            return {}
        lines = data.decode("utf-8", errors="replace").splitlines()
        self._lines = len(lines)
        given: dict[TaskId, int] = {}
        for line in lines:
            task_id, _, run = line.rpartition(" ")
            if 0 < len(task_id) <= MAX_ID_CHARS and task_id.isprintable() and run.isdigit() and len(run) <= 6:
                given[TaskId(task_id)] = max(int(run), given.get(TaskId(task_id), 0))
        return given

    def note(self, task_id: TaskId, run: int) -> bool:
        """Record a task's run given to a runner; False if it could not be written."""
        try:
            if self._file is None:
                self._path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self._path.open("a", encoding="utf-8")
            self._file.write(f"{task_id} {run}\n")
            self._file.flush()
        except OSError as error:
            log.warning("worker: cannot write %s (%s): announcing task %s in the log instead", self._path, error, task_id)
            self._close()
            return False
        self._lines += 1
        return True

    def due_for_compaction(self) -> bool:
        return self._lines >= COMPACT_AT

    def compact(self, keep: Mapping[TaskId, int]) -> None:
        """Rewrite the file with `keep` only (the tasks still in progress, with their runs)."""
        kept = sorted(keep.items())
        temporary = self._path.with_name(self._path.name + ".new")
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_text("".join(f"{task_id} {run}\n" for task_id, run in kept), encoding="utf-8")
            self._close()
            os.replace(temporary, self._path)
        except OSError as error:
            log.warning("worker: cannot rewrite %s (%s); it keeps growing", self._path, error)
            return
        self._lines = len(kept)

    def _close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
