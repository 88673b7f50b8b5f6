"""A runner's part in prefill on one instance and decode on another (docs/multinode.md).

A prefill instance's runner serves prompts' KV caches (`serve`): to the decoding runner the
master chose for a task (`expect`, told by its worker), once, over TCP (exo/runner/prefill_peer.py).
A decode instance's runner asks for a task's cache before it generates (`fetch_into_cache`) and
keeps what it receives in its prompt cache under the prompt's tokens but the last: its generation
then finds the whole prompt cached and takes the last token, as a single process would next.
Whatever goes wrong there (the prefill runner gone, busy past the timeout, a refusal, a cache that
does not check out) is logged and the runner prefills alone: the text is the same either way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor
from typing import Any

from exo.bus.chunk_signing import ChunkSigner
from exo.core.ids import ModelId, TaskId
from exo.core.kv_budget import kv_group_size
from exo.runner.decoding import PromptTooLong
from exo.runner.engine_api import ModelEngine
from exo.runner.kv_transfer import Encoded, encode_cache, limits_for, prefill_for_transfer, rebuild_cache
from exo.runner.prefill_peer import PrefillRefused, PrefillServer, ask_prefill
from exo.runner.protocol import ExpectPrefill, Generate

log = logging.getLogger(__name__)

EXPECT_FOR_S = 600.0  # how long a told task may still ask: a decode queue can be that long
MAX_CONTEXT = 1 << 20  # a model that states no context length


class PrefillSplit:
    def __init__(self, engine: ModelEngine, model_thread: Executor, signer: ChunkSigner | None,
                 timeout_s: float) -> None:
        self.engine = engine  # the runner replaces its engine when it loads a model: it sets this too
        self._model_thread = model_thread
        self._signer = signer
        self._timeout_s = timeout_s  # an ask's whole time, prefill included (EXO_PREFILL_TIMEOUT_S)
        self._server: PrefillServer | None = None
        self._model_id = ModelId("")

    async def serve(self, model_id: str) -> int:
        """Start serving prompts' caches; the port (on every interface)."""
        if self._signer is None:
            raise RuntimeError("a prefill runner needs its node's key to sign the caches it sends")
        self._model_id = ModelId(model_id)
        model = self.engine.model
        self._server = PrefillServer(self._model_id, self._prefill, self._signer,
                                     max_tokens=_context(self.engine), vocab_size=_vocabulary(model))
        return await self._server.start("0.0.0.0", 0)

    def expect(self, request: ExpectPrefill) -> None:
        if self._server is not None:
            self._server.expect(request.task_id, request.asker, request.asker_public_key,
                                time.monotonic() + EXPECT_FOR_S)

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()

    async def _prefill(self, task_id: TaskId, tokens: list[int]) -> Encoded:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._model_thread, self._prefill_now, task_id, tokens)

    def _prefill_now(self, task_id: TaskId, tokens: list[int]) -> Encoded:
        """On the model thread: mlx-lm's own prefill, quantized as the instance's cache is."""
        engine = self.engine
        cache, pending = prefill_for_transfer(engine.model, tokens, kv_bits=engine.kv_bits,
                                              kv_group_size=_group_size(engine.model) if engine.kv_bits else 64,
                                              on_chunk=engine.beat)
        return encode_cache(task_id, self._model_id, pending, cache)

    async def fetch_into_cache(self, request: Generate, model_id: str) -> None:
        """Ask the prefill runner for the request's prompt cache and keep it; on any failure, log and go on."""
        peer = request.prefill
        if peer is None or self._signer is None or not self.engine.prompt_cache.enabled:
            return
        started = time.perf_counter()
        try:
            tokens = await asyncio.to_thread(self._tokens, request)
            if len(tokens) < 2:
                return  # nothing to prefill before the last token
            host, _, port = peer.address.rpartition(":")
            header, payloads = await ask_prefill(
                host.strip("[]"), int(port), task_id=request.task_id, model_id=ModelId(model_id), tokens=tokens,
                signer=self._signer, server_public_key=peer.public_key, limits=self._limits(model_id),
                timeout_s=self._timeout_s)
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._model_thread, self._keep, request, tokens, header, payloads)
        except PromptTooLong:
            return  # the generation refuses it, as it would alone
        except (PrefillRefused, OSError, ValueError, TimeoutError) as error:
            log.warning("task %s: prefilling here, not on node %s: %s", request.task_id, peer.node_id, error)
            return
        log.debug("task %s: prompt cache of %d tokens from node %s in %.3f s", request.task_id, len(tokens) - 1,
                  peer.node_id, time.perf_counter() - started)

    def _tokens(self, request: Generate) -> list[int]:
        return self.engine.encode(self.engine.prompt_for(request.params))

    def _limits(self, model_id: str) -> Any:
        engine = self.engine
        return limits_for(engine.model, ModelId(model_id), max_bytes=engine.prompt_cache.max_bytes,
                          max_tokens=_context(engine), kv_bits=engine.kv_bits,
                          kv_group_size=_group_size(engine.model) if engine.kv_bits else 0)

    def _keep(self, request: Generate, tokens: list[int], header: Any, payloads: list[bytes]) -> None:
        """On the model thread: the received cache becomes the prompt's (all but its last token)."""
        cache = rebuild_cache(header, payloads)
        self.engine.prompt_cache.keep(tokens[:-1], cache, scope=request.params.cache_scope, owner=request.task_id)


def _context(engine: ModelEngine) -> int:
    return int(getattr(engine, "context_length", 0) or 0) or MAX_CONTEXT


def _vocabulary(model: Any) -> int:
    return int(getattr(getattr(model, "args", None), "vocab_size", 0) or 0)


def _group_size(model: Any) -> int:
    args = model.args
    return kv_group_size(getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads)
