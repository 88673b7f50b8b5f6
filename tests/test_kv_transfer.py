"""A prefilled request's KV cache moved to another process over TCP (exo/runner/kv_transfer.py,
its wire format and checks in kv_wire.py):
the decode side continues with exactly mlx-lm's single-process generation (greedy and seeded,
every step's logprobs too; full precision, a quantized cache that travels quantized, a sliding
window), and a stream that is cut, lies in its header or carries a class it may not is refused
with its cause, before any array is read where the header alone says so."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import msgspec
import pytest
from mlx_lm import load
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import KVCache
from mlx_lm.sample_utils import make_sampler

from exo.core.ids import ModelId, TaskId
from exo.runner import kv_transfer as kv
from exo.runner import kv_wire as wire
from exo.runner.prefill import PREFILL_STEP
from tests.support.tiny_model import Dims, make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
MODEL = ModelId("local/tiny")
MAX_TOKENS = 24
MODELS = {"plain": Dims(), "quantizable": Dims(heads=2, kv_heads=2), "sliding": Dims(sliding_window=64)}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kv_models")
    return {name: make_tiny_model(root / name, dims) for name, dims in MODELS.items()}


@pytest.fixture(scope="module")
def loaded(model_dirs: dict[str, Path]) -> dict[str, tuple[Any, Any]]:
    return {name: load(str(path)) for name, path in model_dirs.items()}


@pytest.fixture(scope="module")
def peer() -> Any:
    """The decode side: another OS process (tests/support/kv_peer.py); its port."""
    process = subprocess.Popen([sys.executable, "-m", "tests.support.kv_peer"], cwd=ROOT, stdout=subprocess.PIPE,
                               text=True)
    assert process.stdout is not None
    try:
        yield int(process.stdout.readline())
    finally:
        process.kill()
        process.wait()


def prompt_of(tokenizer: Any, length: int) -> list[int]:
    text = " ".join(f"Day {n}: the fisherman went out on the sea at {n % 12} o'clock and came home with "
                    f"{n * 7 % 13} fish, bread and news of the river." for n in range(length // 50 + 2))
    tokens: list[int] = tokenizer.encode(text)[:length]
    assert len(tokens) == length
    return tokens


def one_process(model: Any, tokenizer: Any, tokens: list[int], *, temperature: float = 0.0, seed: int | None = None,
                **quantized: int) -> dict[str, Any]:
    """mlx-lm's own generation of the whole prompt in this process: the reference."""
    if seed is not None:
        mx.random.seed(seed)
    steps = list(stream_generate(model, tokenizer, mx.array(tokens), max_tokens=MAX_TOKENS,
                                 sampler=make_sampler(temp=temperature), prefill_step_size=PREFILL_STEP, **quantized))
    return {"tokens": [s.token for s in steps], "logprobs": [s.logprobs.tolist() for s in steps]}


async def _to_peer(port: int, settings: dict[str, Any], encoded: kv.Encoded) -> dict[str, Any]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 24)  # logprobs: a long line
    writer.write(json.dumps(settings).encode() + b"\n")
    await kv.send_cache(writer, encoded)
    answer = json.loads(await asyncio.wait_for(reader.readline(), 120))
    writer.close()
    return dict(answer)


def split_across_processes(peer: int, model_dirs: dict[str, Path], loaded: dict[str, tuple[Any, Any]], name: str,
                           tokens: list[int], *, kv_bits: int = 0, temperature: float = 0.0,
                           seed: int | None = None) -> tuple[kv.Encoded, dict[str, Any]]:
    """Prefill here, decode in the peer process: what went over the wire and what the peer generated."""
    model, _ = loaded[name]
    group = 32 if kv_bits else 0
    cache, pending = kv.prefill_for_transfer(model, tokens, kv_bits=kv_bits, kv_group_size=group or 64)
    encoded = kv.encode_cache(TaskId("task"), MODEL, pending, cache)
    settings = {"model_dir": str(model_dirs[name]), "model_id": MODEL, "max_tokens": MAX_TOKENS,
                "temperature": temperature, "seed": seed, "kv_bits": kv_bits, "kv_group_size": group}
    decoded = asyncio.run(_to_peer(peer, settings, encoded))
    assert "tokens" in decoded, decoded
    return encoded, decoded


@pytest.mark.slow  # real inference, in a second process
@pytest.mark.parametrize("length", [10, 1000, 8000])
def test_greedy_decoding_from_a_transferred_cache_is_one_process_generation(peer, model_dirs, loaded, length):
    model, tokenizer = loaded["plain"]
    tokens = prompt_of(tokenizer, length)
    encoded, decoded = split_across_processes(peer, model_dirs, loaded, "plain", tokens)
    reference = one_process(model, tokenizer, tokens)
    assert decoded["tokens"] == reference["tokens"]
    assert decoded["logprobs"] == reference["logprobs"]  # every step's whole distribution, bit for bit
    assert encoded.header.cached_tokens == length - 1 and encoded.header.pending_tokens == tokens[-1:]
    # fp32 keys and values of 2 layers x 2 kv heads x 16 dims, for the cached tokens only (not mlx-lm's spare room)
    assert encoded.nbytes == 2 * 2 * 2 * 16 * 4 * (length - 1)


@pytest.mark.slow  # real inference, in a second process
def test_seeded_sampling_continues_as_one_process(peer, model_dirs, loaded):
    model, tokenizer = loaded["plain"]
    tokens = prompt_of(tokenizer, 1000)
    _, decoded = split_across_processes(peer, model_dirs, loaded, "plain", tokens, temperature=0.9, seed=11)
    reference = one_process(model, tokenizer, tokens, temperature=0.9, seed=11)
    assert decoded["tokens"] == reference["tokens"]
    assert len(set(reference["tokens"])) > 5  # a sampled text, not one token repeated


@pytest.mark.slow  # real inference, in a second process
@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_cache_travels_quantized_and_continues_as_mlx_lm(peer, model_dirs, loaded, bits):
    model, tokenizer = loaded["quantizable"]  # head dim 32: mlx quantizes it in groups of 32
    tokens = prompt_of(tokenizer, 1000)
    encoded, decoded = split_across_processes(peer, model_dirs, loaded, "quantizable", tokens, kv_bits=bits)
    reference = one_process(model, tokenizer, tokens, kv_bits=bits, kv_group_size=32, quantized_kv_start=0)
    assert decoded["tokens"] == reference["tokens"] and decoded["logprobs"] == reference["logprobs"]
    assert decoded["classes"] == ["QuantizedKVCache"] * 2
    keys = encoded.header.layers[0].arrays[0]
    assert (keys.dtype, keys.shape) == ("uint32", [1, 2, 999, 32 * bits // 32])  # packed words, not floats
    scales_and_biases = 2 * 2 * 2 * (32 // 32) * 4 * 999  # one fp32 scale and bias a group, keys and values
    assert encoded.nbytes == 2 * 2 * 2 * (32 * bits // 8) * 999 + 2 * scales_and_biases


@pytest.mark.slow  # real inference, in a second process
def test_a_sliding_window_cache_keeps_its_window_and_continues_as_mlx_lm(peer, model_dirs, loaded):
    model, tokenizer = loaded["sliding"]
    tokens = prompt_of(tokenizer, 1000)
    encoded, decoded = split_across_processes(peer, model_dirs, loaded, "sliding", tokens)
    reference = one_process(model, tokenizer, tokens)
    assert decoded["tokens"] == reference["tokens"] and decoded["logprobs"] == reference["logprobs"]
    assert decoded["classes"] == ["RotatingKVCache", "KVCache"]
    offset, keep, window, _ = encoded.header.layers[0].meta
    assert (offset, keep, window) == (999, 0, 64)


def test_every_float_type_arrives_bit_exact(loaded):
    model, _ = loaded["plain"]
    limits = kv.limits_for(model, MODEL, max_bytes=1 << 20, max_tokens=1000)
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        cache = [KVCache(), KVCache()]
        for layer in cache:
            layer.update_and_fetch(*(mx.random.normal((1, 2, 300, 16)).astype(dtype) for _ in range(2)))
        encoded = kv.encode_cache(TaskId("t"), MODEL, [5], cache)
        header, received = asyncio.run(_received(_wire(encoded), limits))
        assert header == encoded.header
        for sent, got in zip(cache, received, strict=True):
            assert got.offset == 300 and got.keys.dtype == dtype
            assert mx.array_equal(got.keys, sent.keys[..., :300, :]) and mx.array_equal(got.values, sent.values[..., :300, :])


# --- hostile input -------------------------------------------------------------------------------

def _wire(encoded: kv.Encoded, header: Any = None, arrays: list[bytes] | None = None) -> bytes:
    head = msgspec.msgpack.encode(header if header is not None else encoded.header)
    payload = arrays if arrays is not None else [bytes(memoryview(a).cast("B")) for a in encoded.arrays]
    return wire.MAGIC + len(head).to_bytes(4, "big") + head + b"".join(payload) + wire.END


async def _received(data: bytes, limits: wire.TransferLimits, *, then_close: bool = True) -> Any:
    """What receive_cache makes of `data` sent over a real socket (the exception it raised, if it did).
    `then_close` False: the sender keeps the connection open, so a receiver that reads on waits."""
    result: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            result.set_result(await kv.receive_cache(reader, limits))
        except wire.TransferRefused as refused:
            result.set_result(refused)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with server:
        _, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        writer.write(data)
        await writer.drain()
        if then_close:
            writer.write_eof()
        try:
            return await asyncio.wait_for(result, 10)
        finally:
            writer.close()


@pytest.fixture(scope="module")
def sample(loaded: dict[str, tuple[Any, Any]]) -> tuple[kv.Encoded, wire.TransferLimits]:
    """A 10-token prompt's cache, 9 tokens held, ready to send; a receiver's limits for its model."""
    model, tokenizer = loaded["plain"]
    cache, pending = kv.prefill_for_transfer(model, prompt_of(tokenizer, 10))
    return (kv.encode_cache(TaskId("t"), MODEL, pending, cache),
            kv.limits_for(model, MODEL, max_bytes=1 << 20, max_tokens=1000))


def _layers(encoded: kv.Encoded, n: int, **changes: Any) -> list[wire.LayerSpec]:
    layers = list(encoded.header.layers)
    layers[n] = msgspec.structs.replace(layers[n], **changes)
    return layers


def _keys(encoded: kv.Encoded, **changes: Any) -> list[wire.LayerSpec]:
    layer = encoded.header.layers[0]
    return _layers(encoded, 0, arrays=[msgspec.structs.replace(layer.arrays[0], **changes), *layer.arrays[1:]])


def _header(encoded: kv.Encoded, **changes: Any) -> wire.CacheHeader:
    return msgspec.structs.replace(encoded.header, **changes)


def test_the_sample_itself_is_received(sample):
    encoded, limits = sample
    header, cache = asyncio.run(_received(_wire(encoded), limits))
    assert header == encoded.header and [layer.offset for layer in cache] == [9, 9]


def test_a_cut_stream_is_refused_saying_where_it_ended(sample):
    encoded, limits = sample
    data = _wire(encoded)
    last = encoded.header.layers[-1].arrays[-1].nbytes
    refused = asyncio.run(_received(data[:-100], limits))
    assert str(refused) == f"the stream ended in layer 1's values: {last - 96} of {last} bytes came"
    assert str(asyncio.run(_received(data[:20], limits))).startswith("the stream ended in the header: 12 of ")


def _fewer_tokens(encoded: kv.Encoded) -> wire.CacheHeader:
    """A consistent header for 8 cached tokens (the stream then carries 9 tokens' bytes)."""
    def shorter(layer: wire.LayerSpec) -> wire.LayerSpec:
        arrays = [wire.ArraySpec(a.dtype, [1, 2, 8, 16], a.nbytes // 9 * 8) for a in layer.arrays]
        return msgspec.structs.replace(layer, meta=[8], arrays=arrays)
    return _header(encoded, cached_tokens=8, layers=[shorter(layer) for layer in encoded.header.layers])


HOSTILE: dict[str, tuple[Any, str]] = {
    "a dropped last layer": (lambda e: _header(e, layers=e.header.layers[:-1]), "the cache has 1 layers; this model has 2"),
    "a disallowed class": (lambda e: _header(e, layers=_layers(e, 1, cache_class="ArraysCache")),
                           "layer 1 is a 'ArraysCache', not a cache class a transfer may carry "
                           "(KVCache, QuantizedKVCache, RotatingKVCache)"),
    "a class of another layout": (lambda e: _header(e, layers=_layers(e, 0, cache_class="RotatingKVCache")),
                                  "layer 0 is a RotatingKVCache; this model's is a KVCache"),
    "bytes that are not its shape's": (lambda e: _header(e, layers=_keys(e, nbytes=e.header.layers[0].arrays[0].nbytes + 4)),
                                       "layer 0's keys is declared 1156 bytes; its shape [1, 2, 9, 16] of float32 is 1152"),
    "arrays that hold other tokens than the offset": (
        lambda e: _header(e, layers=[msgspec.structs.replace(layer, meta=[9]) for layer in _fewer_tokens(e).layers]),
        "layer 0's arrays hold 8 tokens; its offset is 9"),
    "keys and values of different lengths": (lambda e: _header(e, layers=_keys(e, shape=[1, 2, 8, 16], nbytes=1024)),
                                             "layer 0's arrays disagree on heads or tokens: [(1, 2, 8), (1, 2, 9)]"),
    "more bytes than declared": (_fewer_tokens, "the stream goes on past the arrays its header declares"),
    "a type not allowed": (lambda e: _header(e, layers=_keys(e, dtype="float64", nbytes=2304)),
                           "layer 0's keys is of type 'float64', not one of float32, float16, bfloat16, uint32"),
    "other heads": (lambda e: _header(e, layers=_keys(e, shape=[1, 1, 9, 32])), "layer 0's keys has 1 heads; this model has 2"),
    "a layer's other offset": (lambda e: _header(e, layers=_layers(e, 1, meta=[8])), "layer 1 holds 8 tokens; the header says 9"),
    "another model": (lambda e: _header(e, model_id=ModelId("other")),
                      "the cache is of model 'other'; this runner serves 'local/tiny'"),
    "another version": (lambda e: _header(e, version=2), "transfer version 2; this runner reads version 1"),
    "no pending token": (lambda e: _header(e, pending_tokens=[]), "no pending tokens"),
    "a token outside the vocabulary": (lambda e: _header(e, pending_tokens=[10**6]),
                                       "pending token id 1000000 is outside this model's vocabulary (363)"),
    "an unknown field": (lambda e: {**msgspec.to_builtins(e.header), "extra": 1},
                         "the header is not a KV cache header: Object contains unknown field `extra`"),
    "a negative count": (lambda e: {**msgspec.to_builtins(e.header), "cached_tokens": -1},
                         "the header is not a KV cache header: Expected `int` >= 0 - at `$.cached_tokens`"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_lying_or_disallowed_header_is_refused_with_its_cause(sample, case):
    encoded, limits = sample
    lie, reason = HOSTILE[case]
    refused = asyncio.run(_received(_wire(encoded, lie(encoded)), limits))
    assert isinstance(refused, wire.TransferRefused) and reason in str(refused), refused


def test_limits_refuse_before_any_array_is_read(sample):
    """The sender keeps the connection open after the header: a receiver that read on would wait."""
    encoded, limits = sample
    head = _wire(encoded)[: -encoded.nbytes - len(wire.END)]
    small = dataclasses.replace(limits, max_bytes=encoded.nbytes - 1)
    assert str(asyncio.run(_received(head, small, then_close=False))) == \
        f"the cache is {encoded.nbytes} bytes, more than the {encoded.nbytes - 1} this runner takes"
    short = dataclasses.replace(limits, max_tokens=5)
    assert str(asyncio.run(_received(head, short, then_close=False))) == \
        "9 cached and 1 pending tokens exceed this instance's context of 5"
    quantized = dataclasses.replace(limits, layers=(wire.LayerKind("QuantizedKVCache"),) * 2, kv_bits=4, kv_group_size=32)
    assert str(asyncio.run(_received(head, quantized, then_close=False))) == \
        "layer 0 is a KVCache; this model's is a QuantizedKVCache"
    huge = wire.MAGIC + (1 << 31).to_bytes(4, "big")
    assert str(asyncio.run(_received(huge, limits, then_close=False))) == \
        "the header is 2147483648 bytes, more than the 1048576 allowed"
    assert str(asyncio.run(_received(b"GET / HTTP/1.1\r\n\r\n", limits))) == "not a KV cache transfer (it starts with b'GET ')"
