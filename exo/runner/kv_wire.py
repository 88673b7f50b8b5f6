"""The KV cache transfer's wire format (kv_transfer.py sends and receives it) and what a receiver accepts.

One transfer per connection:

    b"EXKV" | header length (4 bytes, big-endian) | header (msgpack CacheHeader)
    | every array's raw bytes, layer by layer, in the header's order | b"VKXE"

Quantized caches (`kv_bits`) travel as they are held: packed uint32 words, scales and biases.
Everything the header says is checked against the receiving model (`TransferLimits`, `check_header`)
before a byte of arrays is read, so a hostile or broken peer costs at most `max_bytes` and gets a
`TransferRefused` naming the cause.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

import mlx.core as mx
import msgspec
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from exo.core.ids import ModelId, TaskId

MAGIC, END = b"EXKV", b"VKXE"
VERSION = 1
MAX_HEADER_BYTES = 1 << 20
DTYPES: dict[str, mx.Dtype] = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16,
                               "uint32": mx.uint32}
FLOATS = ("float32", "float16", "bfloat16")
QUANTIZED_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
# The non-array part of each allowed class's mlx-lm `state`, in its order (its arrays come first).
META_FIELDS: dict[str, tuple[str, ...]] = {
    "KVCache": ("offset",),
    "QuantizedKVCache": ("offset", "group_size", "bits"),
    "RotatingKVCache": ("offset", "keep", "max_size", "idx"),
}
ARRAY_NAMES: dict[str, tuple[str, ...]] = {
    "KVCache": ("keys", "values"),
    "QuantizedKVCache": ("keys", "key scales", "key biases", "values", "value scales", "value biases"),
    "RotatingKVCache": ("keys", "values"),
}
CACHE_CLASSES: dict[str, Any] = {"KVCache": KVCache, "QuantizedKVCache": QuantizedKVCache,
                                  "RotatingKVCache": RotatingKVCache}

Count = Annotated[int, msgspec.Meta(ge=0)]


class TransferRefused(ValueError):
    """The stream is not a cache this runner can continue from; the message says why."""


class ArraySpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    dtype: str
    shape: list[Count]
    nbytes: Count


class LayerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    cache_class: str
    meta: list[Count]  # the layer's META_FIELDS
    arrays: list[ArraySpec]  # none for an empty layer


class CacheHeader(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="kv_cache",
                  tag_field="kind"):
    version: int = VERSION
    task_id: TaskId
    model_id: ModelId
    cached_tokens: Count  # prompt tokens the cache holds
    pending_tokens: list[Count]  # the prompt's tokens after those: the receiver's first model call takes them
    layers: list[LayerSpec]


_header = msgspec.msgpack.Decoder(CacheHeader)


def decode_header(data: bytes) -> CacheHeader:
    """The header's msgpack, strictly decoded; TransferRefused if it is not one."""
    try:
        return _header.decode(data)
    except msgspec.DecodeError as error:
        raise TransferRefused(f"the header is not a KV cache header: {error}") from None


@dataclass(frozen=True)
class LayerKind:
    """What the receiving model's cache holds at one layer (mlx-lm's make_prompt_cache)."""

    cache_class: str
    max_size: int = 0  # a sliding window's
    keep: int = 0


@dataclass(frozen=True)
class TransferLimits:
    """What a receiver accepts: its model's cache, and bounds on what it reads."""

    model_id: ModelId
    layers: tuple[LayerKind, ...]
    max_bytes: int  # the arrays' bytes, all layers together
    max_tokens: int  # the context: cached plus pending tokens
    vocab_size: int = 0  # 0: token ids unchecked
    kv_heads: int = 0  # 0: unchecked
    head_dim: int = 0  # 0: unchecked
    kv_bits: int = 0  # the receiver's quantized cache (0: full precision)
    kv_group_size: int = 0
    max_header_bytes: int = MAX_HEADER_BYTES


def check_header(header: CacheHeader, limits: TransferLimits) -> None:
    """TransferRefused naming the first thing in `header` that the receiving model cannot take."""
    if header.version != VERSION:
        raise TransferRefused(f"transfer version {header.version}; this runner reads version {VERSION}")
    if header.model_id != limits.model_id:
        raise TransferRefused(f"the cache is of model {header.model_id!r}; this runner serves {limits.model_id!r}")
    if len(header.layers) != len(limits.layers):
        raise TransferRefused(f"the cache has {len(header.layers)} layers; this model has {len(limits.layers)}")
    _check_tokens(header, limits)
    total = 0
    for n, (layer, kind) in enumerate(zip(header.layers, limits.layers, strict=True)):
        _check_layer(n, layer, kind, header.cached_tokens, limits)
        total += sum(spec.nbytes for spec in layer.arrays)
    if total > limits.max_bytes:
        raise TransferRefused(f"the cache is {total} bytes, more than the {limits.max_bytes} this runner takes")


def _check_tokens(header: CacheHeader, limits: TransferLimits) -> None:
    if not header.pending_tokens:
        raise TransferRefused("no pending tokens: the receiver needs at least the prompt's last token")
    if header.cached_tokens + len(header.pending_tokens) > limits.max_tokens:
        raise TransferRefused(f"{header.cached_tokens} cached and {len(header.pending_tokens)} pending tokens "
                              f"exceed this instance's context of {limits.max_tokens}")
    if limits.vocab_size and (bad := [t for t in header.pending_tokens if t >= limits.vocab_size]):
        raise TransferRefused(f"pending token id {bad[0]} is outside this model's vocabulary ({limits.vocab_size})")


def _check_layer(n: int, layer: LayerSpec, kind: LayerKind, cached: int, limits: TransferLimits) -> None:
    if layer.cache_class not in CACHE_CLASSES:
        raise TransferRefused(f"layer {n} is a {layer.cache_class!r}, not a cache class a transfer may carry "
                              f"({', '.join(CACHE_CLASSES)})")
    empty = not layer.arrays and cached == 0
    if layer.cache_class != kind.cache_class and not (empty and layer.cache_class == "KVCache"):
        raise TransferRefused(f"layer {n} is a {layer.cache_class}; this model's is a {kind.cache_class}")
    fields = META_FIELDS[layer.cache_class]
    if len(layer.meta) != len(fields):
        raise TransferRefused(f"layer {n}'s {layer.cache_class} has {len(layer.meta)} state fields, not {len(fields)}")
    meta = dict(zip(fields, layer.meta, strict=True))
    if meta["offset"] != cached:
        raise TransferRefused(f"layer {n} holds {meta['offset']} tokens; the header says {cached}")
    if layer.cache_class == "RotatingKVCache" and (meta["max_size"], meta["keep"]) != (kind.max_size, kind.keep):
        raise TransferRefused(f"layer {n}'s sliding window is {meta['max_size']} (keep {meta['keep']}); "
                              f"this model's is {kind.max_size} (keep {kind.keep})")
    if layer.cache_class == "QuantizedKVCache" and (meta["bits"], meta["group_size"]) != (limits.kv_bits, limits.kv_group_size):
        raise TransferRefused(f"layer {n} is quantized to {meta['bits']} bits in groups of {meta['group_size']}; "
                              f"this instance's cache is {limits.kv_bits} bits in groups of {limits.kv_group_size}")
    if layer.arrays or cached:
        _check_arrays(n, layer, meta, limits)


def _check_arrays(n: int, layer: LayerSpec, meta: dict[str, int], limits: TransferLimits) -> None:
    names = ARRAY_NAMES[layer.cache_class]
    if len(layer.arrays) != len(names):
        raise TransferRefused(f"layer {n}'s {layer.cache_class} has {len(layer.arrays)} arrays, not {len(names)}")
    for name, spec in zip(names, layer.arrays, strict=True):
        where = f"layer {n}'s {name}"
        if spec.dtype not in DTYPES:
            raise TransferRefused(f"{where} is of type {spec.dtype!r}, not one of {', '.join(DTYPES)}")
        if len(spec.shape) != 4 or spec.shape[0] != 1:
            raise TransferRefused(f"{where} has shape {spec.shape}, not (1, heads, tokens, dim)")
        if spec.nbytes != math.prod(spec.shape) * DTYPES[spec.dtype].size:
            raise TransferRefused(f"{where} is declared {spec.nbytes} bytes; its shape {spec.shape} of "
                                  f"{spec.dtype} is {math.prod(spec.shape) * DTYPES[spec.dtype].size}")
        if limits.kv_heads and spec.shape[1] != limits.kv_heads:
            raise TransferRefused(f"{where} has {spec.shape[1]} heads; this model has {limits.kv_heads}")
        _check_width(where, spec, _expected_width(layer.cache_class, name, meta, limits))
    _check_tokens_held(n, layer, meta)


def _expected_width(cache_class: str, name: str, meta: dict[str, int], limits: TransferLimits) -> tuple[str, int]:
    """(dtypes allowed, last dimension) of one array; width 0: unchecked."""
    if cache_class != "QuantizedKVCache":
        return "float", limits.head_dim
    if name in ("keys", "values"):  # packed: 32 // bits elements a word
        return "uint32", limits.head_dim * meta["bits"] // 32
    return "float", limits.head_dim // meta["group_size"]


def _check_width(where: str, spec: ArraySpec, expected: tuple[str, int]) -> None:
    kind, width = expected
    if (kind == "float") != (spec.dtype in FLOATS):
        raise TransferRefused(f"{where} is of type {spec.dtype}, not {'a float type' if kind == 'float' else kind}")
    if width and spec.shape[3] != width:
        raise TransferRefused(f"{where} is {spec.shape[3]} wide; this model's is {width}")


def _check_tokens_held(n: int, layer: LayerSpec, meta: dict[str, int]) -> None:
    """Keys and values hold the same tokens: the cached ones (a sliding window: its buffer)."""
    lengths = {tuple(spec.shape[:3]) for spec in layer.arrays}
    if len(lengths) != 1:
        raise TransferRefused(f"layer {n}'s arrays disagree on heads or tokens: {sorted(lengths)}")
    held = layer.arrays[0].shape[2]
    if layer.cache_class != "RotatingKVCache":
        if held != meta["offset"]:
            raise TransferRefused(f"layer {n}'s arrays hold {held} tokens; its offset is {meta['offset']}")
    elif not (meta["idx"] <= held <= meta["offset"] + meta["max_size"]) or meta["keep"] > meta["max_size"]:
        raise TransferRefused(f"layer {n}'s sliding window buffer of {held} tokens does not fit its state {meta}")
