"""Pipeline parallelism for decoder-only models whose layers sit in `model.model.layers`
(the llama and qwen families): each rank holds a contiguous block of layers.

Every rank runs the same forward pass; layers it does not hold are skipped. The first layer of
a rank's block receives the hidden state from the previous rank, the last one sends it on, and
after the model's last layer the last rank's hidden state is shared with all ranks (all_sum with
zeros elsewhere), so every rank computes the same logits and takes the same next token.

Skipped layers keep no weights; their caches grow with keys and values of width zero, so the
offsets and paddings that masks and batches read are the same on every rank.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn


def _keep_flags(new: nn.Module, old: nn.Module) -> nn.Module:
    """Copy the layer's plain attributes (e.g. llama's `use_sliding`), which the model's loop reads."""
    for key, value in vars(old).items():
        if isinstance(value, (bool, int, float, str)) and not key.startswith("_"):
            setattr(new, key, value)
    return new


class SkippedLayer(nn.Module):
    """A layer another rank runs: the hidden state passes through unchanged."""

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        _advance(kwargs.get("cache", args[1] if len(args) > 1 else None), x)
        return x


def _advance(cache: Any, x: mx.array) -> None:
    """Grow the skipped layer's cache by this input's length, with keys and values of width zero.
    The model builds its attention mask from the first layer's cache, and a batch's caches keep
    each request's offset and padding: a rank that skips layer 0 needs them right all the same."""
    if cache is None or not hasattr(cache, "update_and_fetch"):
        return
    nothing = mx.zeros((x.shape[0], 1, x.shape[1], 0), dtype=x.dtype)
    cache.update_and_fetch(nothing, nothing)


class StageBoundary(nn.Module):
    """Wraps a layer to receive before it (from the previous rank), send after it (to the next),
    and/or share the final hidden state with every rank (after the model's last layer)."""

    def __init__(self, layer: nn.Module, group: mx.distributed.Group, *, receive_from: int | None,
                 send_to: int | None, share_from: int | None) -> None:
        super().__init__()
        self.layer = layer
        self._group = group
        self._receive_from = receive_from
        self._send_to = send_to
        self._share_from = share_from

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        if self._receive_from is not None:
            x = mx.distributed.recv_like(x, self._receive_from, group=self._group)
        x = self.layer(x, *args, **kwargs)
        if self._send_to is not None:
            x = mx.distributed.send(x, self._send_to, group=self._group)
        if self._share_from is not None:
            # Zeros elsewhere, but still depending on x: a rank's send must stay in the graph it evaluates.
            mine = x if self._group.rank() == self._share_from else mx.depends(mx.zeros_like(x), x)
            x = mx.distributed.all_sum(mine, group=self._group)
        _pin_to_cache(kwargs.get("cache", args[1] if len(args) > 1 else None), x)
        return x


def _pin_to_cache(cache: Any, x: mx.array) -> None:
    """Make the layer's cache depend on this boundary's sends and shares. mlx-lm evaluates only
    the caches after each prefill chunk: without this, a rank would skip its send (or a share)
    there and its peer would wait for it forever."""
    if cache is None or not hasattr(cache, "keys"):
        return
    cache.keys = mx.depends(cache.keys if cache.keys is not None else mx.zeros((1,)), x)


def split_layers(model: nn.Module, group: mx.distributed.Group, start: int, end: int) -> None:
    """Keep layers [start, end) on this rank (rank r holds the r-th block, in rank order).

    Call it after the weights are loaded (lazily): wrapping renames the layers' parameters.
    """
    layers = _layers_of(model)
    count, rank, size = len(layers), group.rank(), group.size()
    if not 0 <= start < end <= count:
        raise ValueError(f"layers [{start}, {end}) do not fit a model of {count} layers")
    for index in range(count):
        if not start <= index < end:
            layers[index] = _keep_flags(SkippedLayer(), layers[index])
    roles: dict[int, dict[str, int | None]] = {}
    roles.setdefault(start, {})["receive_from"] = rank - 1 if rank > 0 else None
    roles.setdefault(end - 1, {})["send_to"] = rank + 1 if rank < size - 1 else None
    roles.setdefault(count - 1, {})["share_from"] = size - 1
    for index, role in roles.items():
        wiring = {"receive_from": None, "send_to": None, "share_from": None, **role}
        layers[index] = _keep_flags(StageBoundary(layers[index], group, **wiring), layers[index])


def _layers_of(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, list):
        raise ValueError(f"pipeline sharding needs model.model.layers; {type(model).__name__} has none")
    return layers
