"""When a runner of a multi-node instance must be restarted: a failed batch step (the other ranks
may still wait in its collectives) or a failed single-path generation reports the runner
`failed` (and leaves its request to the worker, or to the master's migration), so the worker
restarts it and the group forms again; on one node the same failures end only their requests.
The runner runs in process on the tiny model, with a real NATS for its text; "multi-node" is a
real Lockstep over MLX's group of one (rank 0, collectives pass through)."""

from __future__ import annotations

import asyncio
import io

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator

from exo.core.requests import ChatMessage, GenerationParams
from exo.runner.distributed import Lockstep
from exo.runner.process import Runner
from exo.runner.protocol import Done, Failed, Generate, report_decoder
from tests.support.tiny_model import make_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


async def reports_of_a_failed_generation(nc, model_dir, *, multi_node: bool, seed: int | None) -> list:
    reports = io.BytesIO()
    runner = Runner(nc, reports)
    runner._engine.load(str(model_dir))
    if multi_node:
        runner._engine.lockstep = Lockstep(mx.distributed.init())
    publisher = asyncio.create_task(runner._replies.publish())
    params = GenerationParams(messages=[ChatMessage(role="user", content="Hello")], max_tokens=10, seed=seed)
    await runner._generate(asyncio.get_running_loop(), Generate(task_id="t1", params=params))
    publisher.cancel()
    return [report_decoder.decode(line) for line in reports.getvalue().splitlines()]


@pytest.mark.parametrize("seed", [None, 3], ids=["batched", "single path"])
async def test_a_failed_step_restarts_a_multi_node_runner_only(nc, model_dir, monkeypatch, seed):
    def out_of_memory(*_, **__):
        raise ValueError("out of memory")

    monkeypatch.setattr(BatchGenerator, "next", out_of_memory)
    monkeypatch.setattr("exo.runner.engine.stream_generate", out_of_memory)
    one_node = await reports_of_a_failed_generation(nc, model_dir, multi_node=False, seed=seed)
    two_nodes = await reports_of_a_failed_generation(nc, model_dir, multi_node=True, seed=seed)
    done = one_node[1]
    assert isinstance(done, Done) and done.finish_reason == "error" and "out of memory" in done.error
    assert len(one_node) == 2  # the request ends; the runner serves on
    # The group broke: the runner is failed and leaves the request to its worker (which ends it, or
    # the master moves it to another instance if a peer's machine is gone): no Done, no error chunk.
    assert len(two_nodes) == 2 and isinstance(two_nodes[1], Failed) and "out of memory" in two_nodes[1].error
