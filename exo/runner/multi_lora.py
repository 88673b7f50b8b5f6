"""Many LoRA adapters on one loaded base model, each row of a batch through the adapter it asks for.

mlx-lm's `LoRALinear` applies one adapter to every row. Here each linear an adapter targets becomes a
`MultiLoRALinear` that holds the `lora_a` / `lora_b` of every resident adapter touching it, stacked
(ranks padded with zeros to the largest there), and one `RowAdapters`, shared by every such layer of
the model, says which adapter each row of the next forward pass uses. A row's output is mlx-lm's
`linear(x) + (scale * ((x @ lora_a) @ lora_b)).astype(x.dtype)` for its adapter, and exactly
`linear(x)` for a row without one or whose adapter does not touch this layer.

Two ways to compute the rows' low-rank terms (bench/multi_lora.py measures them, docs/benchmarks.md):
- "gather": `mx.gather_mm` takes each row's adapter from the stacks, as mlx-lm's SwitchGLU takes
  experts; a row without an adapter here goes through slot 0 with scale 0.
- "grouped": one pair of plain matmuls per adapter present, on its rows, added back with a scatter.

Which linears an adapter targets comes from its adapter_config.json, read as mlx-lm's
`load_adapters` / `linear_to_lora_layers` read it. LoRA only: DoRA rescales the whole weight per
adapter, which a shared base cannot do per row. Adapters of different dtypes on one linear are
stacked in the wider one (mlx-lm would compute the narrower one's terms in its own dtype).

On a rank of a multi-node instance the same holds for the layers it has: a pipeline rank's
adapters touch only its block of layers (the others' weights are skipped), and a tensor rank
holds each adapter sliced as the linear it wraps (lora_shards.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from exo.runner.lora_shards import SHARDED_LINEARS, full_dims, partial_product, shard_pair, summed, sums_over_ranks
from exo.runner.pipeline import SkippedLayer, StageBoundary

Strategy = Literal["gather", "grouped"]
DEFAULT_STRATEGY: Strategy = "gather"  # the faster with mixed rows on this CPU (bench/multi_lora.py, docs/benchmarks.md)
LEAVES = ("lora_a", "lora_b")


@dataclass(frozen=True)
class AdapterConfig:
    """What mlx-lm reads from an adapter_config.json to place an adapter's LoRA layers."""

    num_layers: int  # the last this many blocks (0 or less: all of them, as mlx-lm slices)
    rank: int
    scale: float
    keys: tuple[str, ...] | None  # module paths within a block (or the model's); None: every linear


def read_config(config: Mapping[str, Any]) -> AdapterConfig:
    """ValueError, saying why, for a config this layer cannot serve."""
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise ValueError(f"fine_tune_type {kind!r}: only LoRA adapters share a base per row")
    parameters = config.get("lora_parameters")
    if not isinstance(parameters, Mapping) or not isinstance(config.get("num_layers"), int):
        raise ValueError("adapter_config.json needs num_layers and lora_parameters")
    rank, scale, keys = parameters.get("rank"), parameters.get("scale"), parameters.get("keys")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"lora_parameters.rank must be a positive integer, not {rank!r}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise ValueError(f"lora_parameters.scale must be a number, not {scale!r}")
    if keys is not None and not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise ValueError("lora_parameters.keys must be a list of module paths")
    return AdapterConfig(config["num_layers"], rank, float(scale), None if keys is None else tuple(keys))


@dataclass(frozen=True)
class RowView:
    """One layer's view of the batch. `slots`, `scales`: per row, for gather_mm (slot 0 and scale 0
    where the row's adapter is not here). `groups`: per adapter present, for grouped matmuls:
    (slot, its rank, its scale, its rows; None when it is every row)."""

    slots: mx.array
    scales: mx.array
    groups: tuple[tuple[int, int, float, mx.array | None], ...]


class RowAdapters:
    """Which adapter each row of the next forward pass uses (None: the bare base), shared by every
    MultiLoRALinear of one model. Each distinct set of adapters a layer holds sees its RowView,
    built once per selection."""

    def __init__(self, strategy: Strategy = DEFAULT_STRATEGY) -> None:
        self.strategy: Strategy = strategy
        self.rows: tuple[str | None, ...] = ()
        self.scales: dict[str, float] = {}
        self.ranks: dict[str, int] = {}  # each adapter's own rank (the stacks may pad it)
        self._views: dict[tuple[tuple[str, ...], Any], RowView | None] = {}

    def select(self, rows: Sequence[str | None]) -> None:
        self.rows = tuple(rows)
        self._views.clear()

    def view(self, names: tuple[str, ...], dtype: Any) -> RowView | None:
        """The batch as a layer holding adapters `names` (its stacks' order) sees it; None: no row uses them."""
        key = (names, dtype)
        if key not in self._views:
            self._views[key] = self._build(names, dtype)
        return self._views[key]

    def _build(self, names: tuple[str, ...], dtype: Any) -> RowView | None:
        slots = [names.index(row) if row in names else -1 for row in self.rows]
        if all(slot < 0 for slot in slots):
            return None
        scales = [self.scales[names[slot]] if slot >= 0 else 0.0 for slot in slots]
        groups = []
        for slot in dict.fromkeys(s for s in slots if s >= 0):  # in order of first appearance
            rows = [i for i, s in enumerate(slots) if s == slot]
            every = len(rows) == len(slots)
            groups.append((slot, self.ranks[names[slot]], self.scales[names[slot]],
                           None if every else mx.array(rows, dtype=mx.uint32)))
        return RowView(mx.array([max(s, 0) for s in slots], dtype=mx.uint32),
                       mx.array(scales, dtype=dtype).reshape(-1, 1, 1), tuple(groups))


def linear_dims(linear: nn.Module) -> tuple[int, int]:
    """(input, output) widths of a plain, quantized or tensor-sharded linear, whole (or the one a MultiLoRALinear wraps)."""
    if isinstance(linear, MultiLoRALinear):
        return linear.input_dims, linear.output_dims
    return full_dims(linear)


class MultiLoRALinear(nn.Module):
    """A base linear plus the stacked adapters that touch it: lora_a (n, in, r), lora_b (n, r, out),
    each this rank's slice where the linear is tensor-sharded (`input_dims`, `output_dims`: whole)."""

    def __init__(self, linear: nn.Module, batch: RowAdapters) -> None:
        super().__init__()
        self.linear = linear
        self._batch = batch
        self._names: tuple[str, ...] = ()
        self.input_dims, self.output_dims = linear_dims(linear)
        self.lora_a = mx.zeros((0, self.input_dims, 0))
        self.lora_b = mx.zeros((0, 0, self.output_dims))

    @property
    def adapters(self) -> tuple[str, ...]:
        return self._names

    def add(self, name: str, lora_a: mx.array, lora_b: mx.array) -> None:
        """`lora_a`, `lora_b`: the adapter's whole arrays for this linear."""
        lora_a, lora_b = shard_pair(self.linear, lora_a, lora_b)
        if not self._names:  # the adapter's own arrays and dtype, not promoted by an empty stack's
            self.lora_a, self.lora_b = lora_a[None], lora_b[None]
        else:
            rank = max(int(self.lora_a.shape[2]), int(lora_a.shape[1]))
            stacks_a = [_pad(self.lora_a, 2, rank), _pad(lora_a[None], 2, rank)]
            stacks_b = [_pad(self.lora_b, 1, rank), _pad(lora_b[None], 1, rank)]
            self.lora_a, self.lora_b = mx.concatenate(stacks_a), mx.concatenate(stacks_b)
        self._names = (*self._names, name)
        mx.eval(self.lora_a, self.lora_b)

    def remove(self, name: str, rank: int) -> None:
        """`rank`: the largest rank among the adapters that stay; new buffers, so the old ones are freed."""
        keep = [i for i, held in enumerate(self._names) if held != name]
        self.lora_a = mx.concatenate([self.lora_a[i:i + 1, :, :rank] for i in keep])
        self.lora_b = mx.concatenate([self.lora_b[i:i + 1, :rank, :] for i in keep])
        self._names = tuple(self._names[i] for i in keep)
        mx.eval(self.lora_a, self.lora_b)

    def __call__(self, x: mx.array) -> mx.array:
        if not self._batch.rows:  # nothing selected: every row is the base's (a warm-up, a plain call)
            return self._plain(x)
        if x.shape[0] != len(self._batch.rows):
            raise ValueError(f"the batch has {x.shape[0]} rows but adapters were selected for {len(self._batch.rows)}")
        view = self._batch.view(self._names, self.lora_a.dtype)
        if view is None:
            return self._plain(x)
        partial = sums_over_ranks(self.linear)  # the terms join the base's partial sums before its all_sum
        y: mx.array = partial_product(self.linear, x) if partial else self.linear(x)
        y = y + self._gathered(x, view) if self._batch.strategy == "gather" else self._grouped(x, y, view)
        return summed(self.linear, y) if partial else y

    def _plain(self, x: mx.array) -> mx.array:
        y: mx.array = self.linear(x)
        return y

    def _grouped(self, x: mx.array, y: mx.array, view: RowView) -> mx.array:
        for slot, rank, scale, rows in view.groups:
            a, b = self.lora_a[slot], self.lora_b[slot]
            if rank < a.shape[1]:  # the adapter's own shapes: the same sums as mlx-lm's LoRALinear
                a, b = a[:, :rank], b[:rank]
            part = x if rows is None else x[rows]
            delta = (scale * ((part @ a) @ b)).astype(x.dtype)
            y = y + delta if rows is None else y.at[rows].add(delta)
        return y

    def _gathered(self, x: mx.array, view: RowView) -> mx.array:
        rows = x.reshape(x.shape[0], -1, x.shape[-1])  # one (tokens, in) matrix per row
        z = mx.gather_mm(rows, self.lora_a, rhs_indices=view.slots)
        z = mx.gather_mm(z, self.lora_b, rhs_indices=view.slots)
        delta: mx.array = (view.scales * z).astype(x.dtype).reshape(*x.shape[:-1], z.shape[-1])
        return delta


def _pad(stack: mx.array, axis: int, size: int) -> mx.array:
    widths = [(0, 0)] * stack.ndim
    widths[axis] = (0, size - stack.shape[axis])
    return mx.pad(stack, widths) if size > stack.shape[axis] else stack


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, nn.QuantizedLinear, MultiLoRALinear, *SHARDED_LINEARS))


def _lora_kind(module: nn.Module) -> bool:
    """What mlx-lm's linear_to_lora_layers converts when the config names no keys."""
    kinds = (nn.Linear, nn.QuantizedLinear, MultiLoRALinear, *SHARDED_LINEARS, SwitchLinear, QuantizedSwitchLinear,
             nn.Embedding, nn.QuantizedEmbedding)
    return isinstance(module, kinds) or hasattr(module, "to_lora")


def _base_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """module.named_modules() as if no MultiLoRALinear were there: each one as its base's path, its insides hidden."""
    wrapped = [path for path, m in module.named_modules() if isinstance(m, MultiLoRALinear)]
    return [(path, m) for path, m in module.named_modules()
            if not any(path.startswith(w + ".") for w in wrapped)]


def _held(layer: nn.Module) -> nn.Module | None:
    """A block as this rank has it: itself, the one a pipeline boundary wraps, or None (another rank's,
    skipped here: the model's last layer is a boundary on every rank, around a skipped one on most)."""
    inner = layer.layer if isinstance(layer, StageBoundary) else layer
    return None if isinstance(inner, SkippedLayer) else inner


def target_paths(model: nn.Module, config: AdapterConfig) -> dict[str, str | None]:
    """The modules mlx-lm's linear_to_lora_layers turns into LoRA layers for this config, by the
    paths the adapter's weights name them, each with its path in this rank's model (None: a layer
    another pipeline rank holds; its weights are that rank's to apply)."""
    where = {id(m): path for path, m in model.named_modules()}
    blocks = [(where[id(layer)], _held(layer)) for layer in model.layers]
    keys = set(config.keys) if config.keys is not None else {
        key for _, held in blocks if held is not None for key, m in _base_modules(held) if _lora_kind(m)}
    chosen: dict[str, str | None] = {}
    for block, held in blocks[-max(config.num_layers, 0):]:
        if held is None:
            chosen.update((f"{block}.{key}", None) for key in sorted(keys))
        else:
            chosen.update((f"{block}.{key}", f"{where[id(held)]}.{key}") for key, _ in _base_modules(held) if key in keys)
    chosen.update((path, path) for path, _ in _base_modules(model) if path in keys)  # mlx-lm's second pass: "lm_head"
    return chosen


class MultiLoRA:
    """The adapters resident on one loaded base model: add and remove them without reloading the
    base, and say which row of the next forward pass uses which (`select`)."""

    def __init__(self, model: nn.Module, strategy: Strategy = DEFAULT_STRATEGY) -> None:
        self.model = model
        self.batch = RowAdapters(strategy)
        self._touches: dict[str, list[str]] = {}  # adapter -> the layer paths it changes

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._touches)

    def add_folder(self, name: str, folder: Path) -> None:
        """An adapter as mlx_lm.lora saves it: adapter_config.json and adapters.safetensors."""
        config = json.loads((folder / "adapter_config.json").read_text())
        weights: dict[str, mx.array] = mx.load(str(folder / "adapters.safetensors"))  # type: ignore[assignment]  # a .safetensors file loads as a dict
        self.add(name, config, weights)

    def add(self, name: str, config: Mapping[str, Any], weights: Mapping[str, mx.array]) -> None:
        """Checks everything before changing anything: a refused adapter leaves the model as it was."""
        if name in self._touches:
            raise ValueError(f"adapter {name!r} is resident already")
        settings = read_config(config)
        pairs = self._pairs(name, settings, weights)
        modules = dict(self.model.named_modules())
        for path, (lora_a, lora_b) in pairs.items():
            layer = modules[path]
            if not isinstance(layer, MultiLoRALinear):
                layer = MultiLoRALinear(layer, self.batch)
                _replace(modules, path, layer)
            layer.add(name, lora_a, lora_b)
        self.batch.ranks[name], self.batch.scales[name] = settings.rank, settings.scale
        self._touches[name] = list(pairs)
        self.batch.select(self.batch.rows)  # the layers' views change with what they hold

    def remove(self, name: str) -> None:
        if name not in self._touches:
            raise ValueError(f"adapter {name!r} is not resident")
        if name in self.batch.rows:
            raise ValueError(f"adapter {name!r} is selected for a row of the batch")
        modules = dict(self.model.named_modules())
        for path in self._touches.pop(name):
            layer = modules[path]
            rest = [self.batch.ranks[other] for other in layer.adapters if other != name]
            if rest:
                layer.remove(name, max(rest))
            else:  # nothing else changes it: the bare linear again
                _replace(modules, path, layer.linear)
        del self.batch.scales[name], self.batch.ranks[name]
        self.batch.select(self.batch.rows)

    def select(self, rows: Sequence[str | None]) -> None:
        """Row i of the next forward passes uses adapter rows[i] (None: the base alone)."""
        for i, row in enumerate(rows):
            if row is not None and row not in self._touches:
                raise ValueError(f"rows[{i}]: adapter {row!r} is not resident")
        self.batch.select(rows)

    def _pairs(self, name: str, config: AdapterConfig,
               weights: Mapping[str, mx.array]) -> dict[str, tuple[mx.array, mx.array]]:
        """Each target's (lora_a, lora_b) by its path in this rank's model, checked as mlx-lm's
        load_adapters checks them (whole: a tensor rank slices them as it adds them). A target without
        lora_b is left out: mlx-lm starts lora_b at zero, so it does not change the layer."""
        modules = dict(_base_modules(self.model))
        targets = target_paths(self.model, config)
        allowed = {f"{path}.{leaf}" for path in targets for leaf in LEAVES}
        if unknown := sorted(set(weights) - allowed):
            raise ValueError(f"adapter {name!r}: {unknown[0]} is not an adapter parameter in the model")
        pairs = {}
        for path, here in targets.items():
            if here is None:
                continue
            if not _is_linear(modules[here]):
                raise ValueError(f"adapter {name!r}: {path} is a {type(modules[here]).__name__}, "
                                 "only linear layers take adapters per row")
            lora_a, lora_b = (weights.get(f"{path}.{leaf}") for leaf in LEAVES)
            if lora_b is None:
                continue
            if lora_a is None:
                raise ValueError(f"adapter {name!r}: {path}.lora_b comes without its lora_a")
            input_dims, output_dims = linear_dims(modules[here])
            for leaf, got, want in (("lora_a", lora_a, (input_dims, config.rank)),
                                    ("lora_b", lora_b, (config.rank, output_dims))):
                if tuple(got.shape) != want:
                    raise ValueError(f"adapter {name!r}: {path}.{leaf} has shape {tuple(got.shape)}, "
                                     f"the model and its rank need {want}")
            pairs[here] = (lora_a, lora_b)
        return pairs


def _replace(modules: dict[str, nn.Module], path: str, module: nn.Module) -> None:
    """`modules`: the model's named_modules(), "" the model itself; the targets' parents are modules, not lists."""
    parent, _, key = path.rpartition(".")
    setattr(modules[parent], key, module)
