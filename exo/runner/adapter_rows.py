"""LoRA adapters applied per request on one loaded base model (EXO_ADAPTERS_SHARE_BASE): the
master sends "<base>:<adapter>" to its base's instance, the worker hands the runner the adapter's
folder with the request, and here it becomes resident (multi_lora.py) and is selected for that
request's rows only. Everything here runs on the model thread.

A request's prompt-cache entries are kept in a scope of its adapter's own: a KV cache computed
under one adapter (or the bare base) is never reused under another.

On a multi-node instance rank 0 names each row's adapter to the other ranks (`AdapterRef`, with
the steps of distributed.py), and they make it resident too: its weights fetched from the object
store by sha256, verified, kept in memory. Rank 0 alone refuses a request when every resident
adapter is in use; the others follow whatever it admitted.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
from msgspec.structs import replace

from exo.core.requests import GenerationParams
from exo.runner.decoding import RequestRefused
from exo.runner.distributed import AdapterRef
from exo.runner.multi_lora import MultiLoRA

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapters.safetensors"  # mlx-lm's adapter folder
Fetch = Callable[[str], bytes]  # an adapter's weights from the object store, by their sha256


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
        self._folders: dict[str, Path] = {}  # resident adapter -> its folder (rank 0)
        self._refs: dict[str, AdapterRef] = {}  # resident adapter -> how the other ranks find it

    def hold(self, model: Any, path: str, row: Hashable) -> str:
        """The adapter of `path` resident (added if need be) and held by `row` until `release`."""
        name = adapter_name(path)
        self._hold(model, name, row, lambda multi: multi.add_folder(name, Path(path)), refuse=True)
        self._folders[name] = Path(path)
        return name

    def hold_ref(self, model: Any, ref: AdapterRef, row: Hashable, fetch: Fetch) -> str:
        """Another rank's `hold`: the adapter rank 0 names, fetched by its hash if it is not resident.
        Never refused for room: rank 0 decided the request fits (it holds the same rows)."""
        def add(multi: MultiLoRA) -> None:
            multi.add(ref.name, json.loads(ref.config), fetched_weights(ref.digest, fetch))

        self._hold(model, ref.name, row, add, refuse=False)
        self._refs[ref.name] = ref
        return ref.name

    def _hold(self, model: Any, name: str, row: Hashable, add: Callable[[MultiLoRA], None], refuse: bool) -> None:
        if self.multi is None or self.multi.model is not model:
            self.multi, self._recent = MultiLoRA(model), OrderedDict()
        if name not in self._recent:
            self._make_room(refuse)
            add(self.multi)
        self._recent[name] = None
        self._recent.move_to_end(name)
        self._held[row] = name

    def _make_room(self, refuse: bool) -> None:
        assert self.multi is not None
        in_use = set(self._held.values())
        while len(self._recent) >= self.limit:
            idle = next((name for name in self._recent if name not in in_use), None)
            if idle is None and not refuse:
                return
            if idle is None:
                raise RequestRefused(f"all {self.limit} resident adapters are in use by running requests "
                                     "(EXO_RESIDENT_ADAPTERS); try again shortly")
            self.multi.remove(idle)
            del self._recent[idle]
            self._folders.pop(idle, None)
            self._refs.pop(idle, None)

    def ref_of(self, name: str) -> AdapterRef:
        """Rank 0: what the other ranks need to make a resident adapter theirs (its weights hashed once)."""
        if name not in self._refs:
            folder = self._folders[name]
            digest = hashlib.sha256((folder / WEIGHTS_FILE).read_bytes()).hexdigest()
            self._refs[name] = AdapterRef(name=name, digest=digest, config=(folder / CONFIG_FILE).read_text())
        return self._refs[name]

    def selected_ref(self) -> AdapterRef | None:
        """Rank 0's single path: the adapter selected for its one row, as the other ranks find it."""
        if self.multi is None or len(self.multi.batch.rows) != 1 or self.multi.batch.rows[0] is None:
            return None
        return self.ref_of(self.multi.batch.rows[0])

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
        with self._selected(self.hold(model, path, row), row):
            yield

    @contextmanager
    def alone_fetched(self, model: Any, ref: AdapterRef | None, row: Hashable, fetch: Fetch) -> Iterator[None]:
        """`alone` on another rank, for the adapter rank 0 named (None: the bare base)."""
        if ref is None:
            yield
            return
        with self._selected(self.hold_ref(model, ref, row, fetch), row):
            yield

    @contextmanager
    def _selected(self, name: str, row: Hashable) -> Iterator[None]:
        self.select([name])
        try:
            yield
        finally:
            self.select([])
            self.release(row)


def fetched_weights(digest: str, fetch: Fetch) -> dict[str, mx.array]:
    """An adapter's weights from the object store, checked against their hash and loaded (mlx loads files only)."""
    data = fetch(digest)
    if hashlib.sha256(data).hexdigest() != digest:
        raise ValueError(f"the adapter weights fetched for {digest[:12]} do not hash to it")
    with tempfile.TemporaryDirectory(prefix="exo-adapter-") as folder:
        file = Path(folder) / WEIGHTS_FILE
        file.write_bytes(data)
        weights: dict[str, mx.array] = mx.load(str(file))  # type: ignore[assignment]  # a .safetensors file loads as a dict
        mx.eval(list(weights.values()))  # read now: the file goes with the folder
    return weights


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
