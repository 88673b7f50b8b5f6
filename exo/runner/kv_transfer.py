"""A prefilled request's KV cache, moved from one runner to another over TCP (never through NATS).

The building block of prefill on one instance and decode on another: the prefill side runs the
prompt through mlx-lm's own `generate_step` up to its last token (`prefill_for_transfer`: the same
chunks and the same quantization as a single process), sends the cache (`send_cache`), and the
decode side rebuilds mlx-lm's cache objects (`receive_cache`) and continues with mlx-lm's
generation from the prompt's last token (`continue_generation`). That last token is the one
model call a single process would make next as well, so no logits travel and the text is that
process's, greedy or seeded.

The wire format, and the checks a receiver makes before it reads a byte of arrays, are in kv_wire.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import msgspec
from mlx_lm.generate import GenerationResponse, generate_step, stream_generate
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from exo.core.ids import ModelId, TaskId
from exo.runner import prefill
from exo.runner.kv_wire import (
    ARRAY_NAMES,
    CACHE_CLASSES,
    DTYPES,
    END,
    MAGIC,
    ArraySpec,
    CacheHeader,
    LayerKind,
    LayerSpec,
    TransferLimits,
    TransferRefused,
    check_header,
    decode_header,
)


def limits_for(model: Any, model_id: ModelId, *, max_bytes: int, max_tokens: int, kv_bits: int = 0,
               kv_group_size: int = 0) -> TransferLimits:
    """The limits of a receiver running `model` (with its KV cache quantized to `kv_bits`, if any)."""
    kinds = []
    for layer in make_prompt_cache(model):
        if isinstance(layer, RotatingKVCache):
            kinds.append(LayerKind("RotatingKVCache", layer.max_size, layer.keep))
        elif type(layer) is KVCache:
            kinds.append(LayerKind("QuantizedKVCache" if kv_bits else "KVCache"))
        else:
            raise TransferRefused(f"this model's cache has {type(layer).__name__} layers, which cannot be transferred")
    args = getattr(model, "args", None)
    heads = int(getattr(args, "num_attention_heads", 0) or 0)
    head_dim = int(getattr(args, "head_dim", 0) or (getattr(args, "hidden_size", 0) // heads if heads else 0))
    return TransferLimits(model_id=model_id, layers=tuple(kinds), max_bytes=max_bytes, max_tokens=max_tokens,
                          vocab_size=int(getattr(args, "vocab_size", 0) or 0),
                          kv_heads=int(getattr(args, "num_key_value_heads", 0) or heads),
                          head_dim=0 if hasattr(args, "v_head_dim") else head_dim,
                          kv_bits=kv_bits, kv_group_size=kv_group_size if kv_bits else 0)


class _PrefillDone(Exception):
    pass


def prefill_for_transfer(model: Any, tokens: list[int], *, kv_bits: int = 0, kv_group_size: int = 64,
                         quantized_kv_start: int = 0, prefill_step_size: int = prefill.PREFILL_STEP,
                         on_chunk: Callable[[], None] = lambda: None) -> tuple[list[Any], list[int]]:
    """(the cache of every prompt token but the last, [the last]): mlx-lm's generate_step stopped
    where its prefill ends, so the chunks and the quantization are a single process's exactly.
    `quantized_kv_start` 0: quantized from the first token, as exo runs a kv_bits instance."""
    if not tokens:
        raise ValueError("an empty prompt has nothing to prefill")
    cache = make_prompt_cache(model)

    def stop_before_last(processed: int, total: int) -> None:
        on_chunk()
        if processed >= total - 1:
            raise _PrefillDone

    steps = generate_step(mx.array(tokens), model, prompt_cache=cache, kv_bits=kv_bits or None,
                          kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
                          prefill_step_size=prefill_step_size, prompt_progress_callback=stop_before_last)
    try:
        next(steps)
    except _PrefillDone:
        return cache, tokens[-1:]
    raise AssertionError("generate_step sampled before its prefill ended")


def continue_generation(model: Any, tokenizer: Any, header: CacheHeader, cache: list[Any],
                        **kwargs: Any) -> Iterator[GenerationResponse]:
    """mlx-lm's stream_generate from a received cache: its first model call takes the pending tokens.
    `kwargs`: stream_generate's (max_tokens, sampler, kv_bits, ...), as a single process passes them."""
    steps: Iterator[GenerationResponse] = stream_generate(model, tokenizer, mx.array(header.pending_tokens),
                                                          prompt_cache=cache, **kwargs)
    return steps


@dataclass(frozen=True)
class Encoded:
    """A cache ready to go: its header and its arrays, evaluated and contiguous, in wire order."""

    header: CacheHeader
    arrays: list[mx.array]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


def encode_cache(task_id: TaskId, model_id: ModelId, pending_tokens: list[int], cache: list[Any]) -> Encoded:
    """Runs mlx: on the model thread in a runner."""
    layers, arrays = [], []
    for layer in cache:
        name = type(layer).__name__
        if name not in CACHE_CLASSES:
            raise TransferRefused(f"a {name} layer cannot be transferred (only {', '.join(CACHE_CLASSES)})")
        meta, held = _state_of(layer)
        held = [mx.contiguous(a) for a in held]
        layers.append(LayerSpec(cache_class=name, meta=meta, arrays=[
            ArraySpec(dtype=_dtype_name(a.dtype), shape=list(a.shape), nbytes=a.nbytes) for a in held]))
        arrays.extend(held)
    mx.eval(arrays)
    offsets = {layer.meta[0] for layer in layers}
    if len(offsets) > 1:
        raise TransferRefused(f"the cache's layers hold different numbers of tokens: {sorted(offsets)}")
    header = CacheHeader(task_id=task_id, model_id=model_id, cached_tokens=offsets.pop() if offsets else 0,
                         pending_tokens=pending_tokens, layers=layers)
    return Encoded(header, arrays)


def _state_of(layer: Any) -> tuple[list[int], list[mx.array]]:
    """(meta, arrays) of one layer. Full-attention caches send their tokens only, not the empty
    room mlx-lm keeps after them; a sliding window's buffer goes as it is (its order is in `idx`)."""
    if layer.empty():
        arrays: list[mx.array] = []
    elif isinstance(layer, RotatingKVCache):
        arrays = [layer.keys, layer.values]
    elif isinstance(layer, QuantizedKVCache):
        arrays = [part[..., : layer.offset, :] for part in (*layer.keys, *layer.values)]
    else:
        arrays = [layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]]
    if isinstance(layer, RotatingKVCache):
        return [layer.offset, layer.keep, layer.max_size, layer._idx], arrays
    if isinstance(layer, QuantizedKVCache):
        return [layer.offset, layer.group_size, layer.bits], arrays
    return [layer.offset], arrays


def _dtype_name(dtype: mx.Dtype) -> str:
    name = next((n for n, d in DTYPES.items() if d == dtype), None)
    if name is None:
        raise TransferRefused(f"a cache array of type {dtype} cannot be transferred (only {', '.join(DTYPES)})")
    return name


async def send_cache(writer: asyncio.StreamWriter, encoded: Encoded) -> int:
    """Write one transfer; the bytes sent. The arrays go straight from mlx's memory to the socket."""
    header = msgspec.msgpack.encode(encoded.header)
    writer.write(MAGIC + len(header).to_bytes(4, "big") + header)
    for array in encoded.arrays:
        # Flat bytes: the transport slices what a send leaves over, and a 4-d view slices by rows.
        writer.write(memoryview(array).cast("B"))  # type: ignore[arg-type]  # mlx arrays export the buffer protocol
        await writer.drain()
    writer.write(END)
    await writer.drain()
    return len(MAGIC) + 4 + len(header) + encoded.nbytes + len(END)


async def receive_cache(reader: asyncio.StreamReader, limits: TransferLimits) -> tuple[CacheHeader, list[Any]]:
    """Read one transfer and rebuild mlx-lm's cache objects (rebuilding runs mlx: see rebuild_cache)."""
    header, payloads = await receive_frames(reader, limits)
    return header, rebuild_cache(header, payloads)


async def receive_frames(reader: asyncio.StreamReader, limits: TransferLimits) -> tuple[CacheHeader, list[bytes]]:
    """The checked header and every array's bytes; nothing past what the header (once checked) declares is read."""
    start = await _read(reader, len(MAGIC) + 4, "the header's length")
    if start[: len(MAGIC)] != MAGIC:
        raise TransferRefused(f"not a KV cache transfer (it starts with {start[:len(MAGIC)]!r})")
    length = int.from_bytes(start[len(MAGIC):], "big")
    if length > limits.max_header_bytes:
        raise TransferRefused(f"the header is {length} bytes, more than the {limits.max_header_bytes} allowed")
    header = decode_header(await _read(reader, length, "the header"))
    check_header(header, limits)
    payloads = []
    for n, layer in enumerate(header.layers):
        names = ARRAY_NAMES[layer.cache_class]
        for name, spec in zip(names, layer.arrays, strict=False):  # an empty layer has none
            payloads.append(await _read(reader, spec.nbytes, f"layer {n}'s {name}"))
    if (end := await _read(reader, len(END), "the end marker")) != END:
        raise TransferRefused(f"the stream goes on past the arrays its header declares ({end!r} where the end marker belongs)")
    return header, payloads


async def _read(reader: asyncio.StreamReader, size: int, what: str) -> bytes:
    try:
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError as error:
        raise TransferRefused(f"the stream ended in {what}: {len(error.partial)} of {size} bytes came") from None


def rebuild_cache(header: CacheHeader, payloads: list[bytes]) -> list[Any]:
    """mlx-lm's cache objects from a checked header and its arrays' bytes. Runs mlx: on the model thread."""
    arrays = iter(payloads)
    cache = []
    for layer in header.layers:
        held = [_array_of(next(arrays), spec) for spec in layer.arrays]
        keys: Any
        values: Any
        if layer.cache_class == "QuantizedKVCache":
            keys, values = (tuple(held[:3]), tuple(held[3:])) if held else (None, None)
        else:
            keys, values = (held[0], held[1]) if held else (None, None)
        cache.append(CACHE_CLASSES[layer.cache_class].from_state((keys, values, *layer.meta)))
    mx.eval([layer.state for layer in cache])
    return cache


def _array_of(data: bytes, spec: ArraySpec) -> mx.array:
    if not spec.nbytes:
        return mx.zeros(spec.shape, DTYPES[spec.dtype])
    raw: Any = memoryview(data)  # mlx copies a buffer's bytes (its stubs do not list buffers)
    return mx.array(raw).view(DTYPES[spec.dtype]).reshape(spec.shape)
