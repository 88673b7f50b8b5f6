"""One rank of a two-rank instance, in a process of its own, for tests/test_lockstep_batch.py.

    python -m tests.support.lockstep_ranks RANK HOSTS_JSON MODEL_DIR SHARDING START END REQUESTS_JSON

Rank 0 runs the requests through the runner's Batcher (seeded ones on the single path, as the
runner does), started as the requests say, then releases the other rank and prints, per
request, [text, finish reason, completion tokens] as JSON. Rank 1 follows (exo/runner/follower.py).
A request's "adapter" (a LoRA adapter's folder) applies to its rows alone, as the runner serves
"<base>:<adapter>" (adapter_rows.py); rank 1 gets its weights by hash from the requests' folders.
Both then print the tokens their batch generated, by request id: the ranks must agree.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mlx_lm.generate import BatchGenerator

from exo.core.ids import TaskId
from exo.core.requests import ChatMessage, GenerationParams, ResponseFormat
from exo.core.types import SamplingDefaults
from exo.runner.adapter_rows import adapter_scoped
from exo.runner.batch import Batcher, batchable
from exo.runner.decoding import GenerationResult, Output
from exo.runner.engine import Engine
from exo.runner.follower import follow
from exo.runner.protocol import RankSetup


def params_of(request: dict[str, Any]) -> GenerationParams:
    """A request: "text" (one user message) or "messages" ([role, content] pairs), and its settings."""
    settings = {k: v for k, v in request.items()
                if k not in ("text", "messages", "join_after", "cancel_after", "after_done", "adapter")}
    turns = request.get("messages") or [["user", request["text"]]]
    if "response_format" in settings:
        settings["response_format"] = ResponseFormat(**settings["response_format"])
    return GenerationParams(messages=[ChatMessage(role=r, content=c) for r, c in turns], **{"temperature": 0, **settings})


async def lead(engine: Engine, requests: list[dict[str, Any]]) -> list[list[object]]:
    """Per request: [text, finish reason, completion tokens]."""
    loop = asyncio.get_running_loop()
    model_thread = ThreadPoolExecutor(max_workers=1)
    batcher = Batcher(engine, 8, model_thread)
    outs: list[list[Output]] = [[] for _ in requests]
    futures: list[asyncio.Future[GenerationResult]] = []
    for i, request in enumerate(requests):
        after = request.get("join_after")  # start once request `after[0]` has sent `after[1]` outputs
        while after and len(outs[after[0]]) < after[1]:
            await asyncio.sleep(0.001)
        if "after_done" in request:  # the next turn of a conversation: once the one before has ended
            await futures[request["after_done"]]
        limit = request.get("cancel_after")
        def cancelled(i: int = i, limit: int | None = limit) -> bool:
            return limit is not None and len(outs[i]) >= limit
        adapter = request.get("adapter", "")
        params = adapter_scoped(params_of(request), adapter)
        if batchable(params, {}, multi_node=True):
            futures.append(batcher.run(loop, params, SamplingDefaults(), outs[i].append, cancelled, TaskId(f"task{i}"),
                                       adapter_path=adapter))
        else:
            futures.append(loop.run_in_executor(model_thread, alone, engine, params, adapter, outs[i].append,
                                                cancelled, TaskId(f"task{i}")))
    results = await asyncio.gather(*futures)
    await loop.run_in_executor(model_thread, engine.release_followers)
    print(json.dumps([r.cached_tokens for r in results]), flush=True)  # prompt tokens reused from the prompt cache
    return [["".join(o.text for o in out), r.finish_reason, r.completion_tokens] for out, r in zip(outs, results)]


def alone(engine: Engine, params: GenerationParams, adapter: str, on_output: Callable[[Output], None],
          cancelled: Callable[[], bool], task_id: TaskId) -> GenerationResult:
    """The single path, as the runner takes it (process.py): the row's adapter selected while it runs."""
    with engine.adapters.alone(engine.model, adapter, task_id):
        return engine.generate(params, SamplingDefaults(), on_output, cancelled, task_id)


def fetch_from(requests: list[dict[str, Any]]) -> Callable[[str], bytes]:
    """Rank 1's object store: the weights of the requests' adapter folders, by their sha256."""
    files = [Path(r["adapter"]) / "adapters.safetensors" for r in requests if r.get("adapter")]
    by_digest = {hashlib.sha256(f.read_bytes()).hexdigest(): f for f in files}
    return lambda digest: by_digest[digest].read_bytes()


def record_batch_tokens() -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = defaultdict(list)
    step = BatchGenerator.next

    def next_recorded(self: Any) -> tuple[Any, Any]:  # mlx-lm's BatchGenerator: (prompts, responses)
        prompts, generated = step(self)
        for response in generated:
            tokens[response.uid].append(response.token)
        return prompts, generated

    BatchGenerator.next = next_recorded
    return tokens


def main() -> None:
    rank, hosts, model_dir, sharding, start, end, requests = sys.argv[1:8]
    batch_tokens = record_batch_tokens()
    engine = Engine()
    engine.load(model_dir, RankSetup(rank=int(rank), ring_hosts=json.loads(hosts), sharding=sharding,
                                     start_layer=int(start), end_layer=int(end)))
    if int(rank) == 0:
        results = asyncio.run(lead(engine, json.loads(requests)))
        print(json.dumps(results), flush=True)
    else:
        follow(engine, fetch_from(json.loads(requests)))
    print(json.dumps(batch_tokens), flush=True)
    os._exit(0)  # as the runner leaves a group: MLX's ring threads must not be torn down by the interpreter


if __name__ == "__main__":
    main()
