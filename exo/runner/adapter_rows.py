"""LoRA adapters applied per request on one loaded base model (EXO_ADAPTERS_SHARE_BASE): the
master sends "<base>:<adapter>" to its base's instance, the worker hands the runner the adapter's
folder with the request, and here it becomes resident (multi_lora.py) and is selected for that
request's rows only. Everything here runs on the model thread.

A request's prompt-cache entries are kept in a scope of its adapter's own: a KV cache computed
under one adapter (or the bare base) is never reused under another.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from msgspec.structs import replace

from exo.core.requests import GenerationParams
from exo.runner.decoding import RequestRefused
from exo.runner.multi_lora import MultiLoRA


def adapter_name(path: str) -> str:
    """The folder's name: the worker names it by the weights' and the config's hashes together."""
    return Path(path).name


def adapter_scoped(params: GenerationParams, adapter_path: str) -> GenerationParams:
    """The request's cache scope, narrowed to its adapter: entries of other adapters are not its."""
    if not adapter_path:
        return params
    return replace(params, cache_scope=f"{params.cache_scope}\x1fadapter:{adapter_name(adapter_path)}")


class ResidentAdapters:
    """The adapters loaded beside the base: at most `limit`, least recently used out, never one a
    running row holds. The base becomes a MultiLoRA on the first adapter asked for."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.multi: MultiLoRA | None = None
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._held: dict[Hashable, str] = {}  # a running row -> its adapter

    def hold(self, model: Any, path: str, row: Hashable) -> str:
        """The adapter of `path` resident (added if need be) and held by `row` until `release`."""
        name = adapter_name(path)
        if self.multi is None or self.multi.model is not model:
            self.multi, self._recent = MultiLoRA(model), OrderedDict()
        if name not in self._recent:
            self._make_room()
            self.multi.add_folder(name, Path(path))
        self._recent[name] = None
        self._recent.move_to_end(name)
        self._held[row] = name
        return name

    def _make_room(self) -> None:
        assert self.multi is not None
        in_use = set(self._held.values())
        while len(self._recent) >= self.limit:
            idle = next((name for name in self._recent if name not in in_use), None)
            if idle is None:
                raise RequestRefused(f"all {self.limit} resident adapters are in use by running requests "
                                     "(EXO_RESIDENT_ADAPTERS); try again shortly")
            self.multi.remove(idle)
            del self._recent[idle]

    def release(self, row: Hashable) -> None:
        self._held.pop(row, None)

    def held_by(self, row: Hashable) -> str | None:
        return self._held.get(row)

    def select(self, rows: Sequence[str | None]) -> None:
        if self.multi is not None:
            self.multi.select(rows)

    @property
    def resident(self) -> tuple[str, ...]:
        return tuple(self._recent)

    @contextmanager
    def alone(self, model: Any, path: str, row: Hashable) -> Iterator[None]:
        """The single path: one row, through its adapter while the block runs."""
        if not path:
            yield
            return
        name = self.hold(model, path, row)
        self.select([name])
        try:
            yield
        finally:
            self.select([])
            self.release(row)


class RowSelectingModel:
    """BatchGenerator's model: before each forward pass, selects each row's adapter from the uids of
    the batch being run (mlx-lm's prompt and generation batches both call `self.model(...)` and
    hold their rows' uids in order as `self.uids`). Without resident adapters it only forwards."""

    def __init__(self, model: Any, adapters: ResidentAdapters, row_of: Callable[[int], Hashable]) -> None:
        self.base, self._adapters, self._row_of = model, adapters, row_of

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if self._adapters.multi is None:
            return self.base(inputs, *args, **kwargs)
        uids = getattr(sys._getframe(1).f_locals.get("self"), "uids", None)
        if uids is None or len(uids) != inputs.shape[0]:
            raise RuntimeError("cannot tell which rows this forward pass runs: mlx-lm's batch changed its layout")
        self._adapters.select([self._adapters.held_by(self._row_of(uid)) for uid in uids])
        try:
            return self.base(inputs, *args, **kwargs)
        finally:
            self._adapters.select([])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)
