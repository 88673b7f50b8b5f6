"""The decode side of a KV cache transfer, in a process of its own, for tests/test_kv_transfer.py.

    python -m tests.support.kv_peer

Prints the port it listens on (127.0.0.1), then takes one connection at a time: a JSON line of
settings ({"model_dir", "model_id", "max_tokens", "temperature", "seed", "kv_bits",
"kv_group_size", "max_bytes"}), then one transfer (exo/runner/kv_transfer.py). It answers one JSON
line: {"tokens", "logprobs" (each step's whole vector), "classes" (the rebuilt layers')} from
mlx-lm's generation continued on the received cache ("max_tokens" 0: the cache rebuilt, nothing
decoded: bench/kv_transfer.py), {"refused": the reason} or {"error": ...}.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import mlx.core as mx
from mlx_lm import load
from mlx_lm.sample_utils import make_sampler

from exo.core.ids import ModelId
from exo.runner import kv_transfer, kv_wire

_models: dict[str, tuple[Any, Any]] = {}


def _model(path: str) -> tuple[Any, Any]:
    if path not in _models:
        _models[path] = load(path)
    return _models[path]


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    settings = json.loads(await reader.readline())
    model, tokenizer = _model(settings["model_dir"])
    kv_bits, group = settings.get("kv_bits", 0), settings.get("kv_group_size", 0)
    limits = kv_transfer.limits_for(model, ModelId(settings["model_id"]), max_bytes=settings.get("max_bytes", 1 << 30),
                                    max_tokens=32768, kv_bits=kv_bits, kv_group_size=group)
    try:
        header, cache = await kv_transfer.receive_cache(reader, limits)
        decoded = _decode(model, tokenizer, header, cache, settings) if settings["max_tokens"] else {}
        answer: dict[str, Any] = {"classes": [type(layer).__name__ for layer in cache], **decoded}
    except kv_wire.TransferRefused as refused:
        answer = {"refused": str(refused)}
    except Exception as error:  # the test shows it, rather than a connection closed without a word
        answer = {"error": repr(error)}
    writer.write(json.dumps(answer).encode() + b"\n")
    await writer.drain()
    writer.close()


def _decode(model: Any, tokenizer: Any, header: kv_wire.CacheHeader, cache: list[Any],
            settings: dict[str, Any]) -> dict[str, Any]:
    if settings.get("seed") is not None:
        mx.random.seed(settings["seed"])  # mlx-lm's way to seed a generation
    quantized = {"kv_bits": settings["kv_bits"], "kv_group_size": settings["kv_group_size"],
                 "quantized_kv_start": 0} if settings.get("kv_bits") else {}
    tokens, logprobs = [], []
    for response in kv_transfer.continue_generation(model, tokenizer, header, cache, max_tokens=settings["max_tokens"],
                                                    sampler=make_sampler(temp=settings.get("temperature", 0.0)),
                                                    **quantized):
        tokens.append(response.token)
        logprobs.append(response.logprobs.tolist())
    return {"tokens": tokens, "logprobs": logprobs}


async def main() -> None:
    server = await asyncio.start_server(_serve, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(0)
