"""One instance across several runners: an MLX ring group over TCP, and lockstep generation.

Rank 0 is the only rank the worker gives requests to. It tells the other ranks what to run, one
message at a time: a request for the single path (`StepAnnouncement`), after which every sampled
token is broadcast with its cancel flag, or a step of the batch (`BatchStep`: who joins, who
leaves, then one BatchGenerator step whose sampled tokens are broadcast too). So all ranks take
the same tokens, make the same stop decisions and end at the same step. Only rank 0 publishes text.

Every collective runs on mlx-lm's generation stream: a stream runs its work in order, and the
ranks must run their collectives in the same order (a token broadcast still in flight on one
stream must not cross the next message's on another).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import msgspec
from mlx.utils import tree_unflatten
from mlx_lm.generate import generation_stream
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_model, load_tokenizer, sharded_load

from exo.core.ids import TaskId
from exo.core.requests import REPETITION_CONTEXT, GenerationParams
from exo.core.types import SamplingDefaults
from exo.runner.pipeline import split_layers

Sampler = Callable[[mx.array], mx.array]


def join_ring(rank: int, hosts: list[str], timeout_s: float) -> mx.distributed.Group:
    """Connect to the other ranks (each listens on its own "ip:port"); blocks until all are there."""
    hostfile = Path(tempfile.gettempdir()) / f"exo-ring-{os.getpid()}.json"
    hostfile.write_text(json.dumps([[host] for host in hosts]))
    # mlx's ring backend reads these two from the environment: its only interface (a runner serves one instance).
    os.environ["MLX_RANK"] = str(rank)
    os.environ["MLX_HOSTFILE"] = str(hostfile)
    # init can block for good (seen when a peer first reached a stale process on its port, or the
    # group formed while a replacement's ranks started seconds apart); it cannot be interrupted,
    # so the process leaves with the reason and its worker restarts it (its peers rejoin).
    watchdog = threading.Timer(timeout_s, _give_up_joining, args=(hosts, timeout_s))
    watchdog.daemon = True
    watchdog.start()
    try:
        group = mx.distributed.init(strict=True, backend="ring")
    finally:
        watchdog.cancel()
        hostfile.unlink(missing_ok=True)  # read once, by init
    if group.size() != len(hosts) or group.rank() != rank:
        raise RuntimeError(f"ring group is rank {group.rank()} of {group.size()}, expected {rank} of {len(hosts)}")
    return group


def _give_up_joining(hosts: list[str], timeout_s: float) -> None:
    sys.stderr.write(f"the ring group {hosts} did not form within {timeout_s:g} s "
                     "(EXO_RING_JOIN_TIMEOUT_S); exiting so that it is formed again\n")
    sys.stderr.flush()
    os._exit(3)


def load_shard(model_path: str, group: mx.distributed.Group, sharding: str, start: int, end: int,
               adapter_path: str = "") -> tuple[Any, Any]:
    """The model with this rank's part of it in memory: a slice of every layer (tensor) or a
    block of layers (pipeline). A LoRA adapter is applied to the whole model first, as mlx-lm
    applies it; tensor sharding splits plain linear layers, so there it is fused into them first."""
    path = Path(model_path)
    if sharding == "tensor" and not adapter_path:
        # mlx-lm's own (it raises for architectures it cannot shard); given a local path it downloads nothing.
        loaded: tuple[Any, Any] = sharded_load(str(path), tensor_group=group)  # (model, tokenizer)
        return loaded
    model, config = load_model(path, lazy=True, strict=False)
    if adapter_path:
        from mlx_lm.tuner.utils import load_adapters  # here: mlx-lm's trainer (and rich) load only with an adapter

        load_adapters(model, adapter_path)
    if sharding == "tensor":
        _fuse_adapter(model)
        model.shard(group)  # as sharded_load does, on the adapted weights
    else:
        split_layers(model, group, start, end)
    mx.eval(model.parameters())
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))  # everyone loaded before anyone serves
    return model, tokenizer


def _fuse_adapter(model: Any) -> None:
    """Each LoRA layer folded into its linear layer (mlx_lm.fuse's way), so the model shards as a plain one."""
    fused = [(name, module.fuse()) for name, module in model.named_modules() if hasattr(module, "fuse")]
    if fused:
        model.update_modules(tree_unflatten(fused))


def broadcast_bytes(group: mx.distributed.Group, data: bytes | None) -> bytes:
    """Rank 0 sends `data`; every rank returns it (others pass None). Two collectives: size, then bytes."""
    is_root = group.rank() == 0
    with mx.stream(generation_stream):
        size = mx.distributed.all_sum(mx.array([len(data) if is_root and data else 0], dtype=mx.int32), group=group)
        total: Any = size.item()
        length = int(total)
        if length == 0:
            return b""
        # int32, not uint8: the ring backend's sums of small integer types came out as zeros.
        payload = mx.array(list(data), dtype=mx.int32) if is_root and data else mx.zeros((length,), dtype=mx.int32)
        received = mx.distributed.all_sum(payload, group=group)  # zeros elsewhere: the sum is rank 0's bytes
        mx.eval(received)  # on rank 0 too: a collective left unevaluated would leave the others waiting
        return data if is_root and data else bytes(memoryview(received.astype(mx.uint8)))  # type: ignore[arg-type]


class AdapterRef(msgspec.Struct, frozen=True, kw_only=True):
    """A request's LoRA adapter, as every rank can make it resident: rank 0 has its folder from
    the worker; the others fetch its weights from the object store by sha256 (adapter_rows.py)."""

    name: str  # its folder's name on rank 0: the weights' and the config's hashes (the adapter's identity)
    digest: str  # the sha256 of its adapters.safetensors
    config: str  # its adapter_config.json


class StepAnnouncement(msgspec.Struct, frozen=True, kw_only=True, tag="generate"):
    """Rank 0 runs this request on the single path: run it too."""

    task_id: TaskId
    params: GenerationParams
    defaults: SamplingDefaults = SamplingDefaults()
    cached: int = 0  # prompt tokens rank 0 reuses from its prompt cache: every rank reuses as many
    cache_entries: int = 0  # rank 0's prompt-cache entries before this request: the others drop as many
    resume_tokens: list[int] = []  # a resumed request's earlier tokens (protocol.Resume): every rank prefills them
    adapter: AdapterRef | None = None  # the LoRA adapter of its row (None: the bare base)


Sampling = tuple[float, float, int, float]  # temperature, top_p, top_k, min_p


class BatchJoin(msgspec.Struct, frozen=True, kw_only=True):
    """A request entering the batch: what BatchGenerator.insert needs, nothing of its text."""

    tokens: list[int]
    max_tokens: int
    sampling: Sampling
    # Its logits processors' settings (engine.logits_processors_of), as GenerationParams has them.
    logit_bias: dict[int, float] = {}
    repetition_penalty: float | None = None
    repetition_context_size: int = REPETITION_CONTEXT
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    cached: int = 0  # prompt tokens reused from rank 0's prompt cache (see StepAnnouncement)
    cache_scope: str = ""  # the request's GenerationParams.cache_scope: every rank stores and looks up there
    adapter: AdapterRef | None = None  # its rows' LoRA adapter (None: the bare base), selected on every rank


class BatchStep(msgspec.Struct, frozen=True, kw_only=True, tag="step"):
    """One step of rank 0's batch: start a new batch of this size (0: keep the batch), remove these
    requests (they ended by a stop string or a cancel), insert these, then step."""

    new_batch: int = 0
    leaves: list[int] = []
    joins: list[BatchJoin] = []
    cache_entries: int = 0  # rank 0's prompt-cache entries before the joins (see StepAnnouncement)


Message = StepAnnouncement | BatchStep
_message = msgspec.json.Decoder(Message)


class Lockstep:
    """Keeps the ranks of one instance in step: the same requests in the same order, and per
    generation the same tokens and the same moment to stop, all decided by rank 0."""

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group

    @property
    def leads(self) -> bool:
        return self.group.rank() == 0

    def announce(self, message: Message | None) -> None:
        """Rank 0: tell the others what to run next (None: stop following, the runner is leaving)."""
        broadcast_bytes(self.group, msgspec.json.encode(message) if message else b"")

    def next_message(self) -> Message | None:
        """Other ranks: wait for rank 0's next message (None: rank 0 is shutting down)."""
        data = broadcast_bytes(self.group, None)
        return _message.decode(data) if data else None

    def agreed(self, sampler: Sampler) -> Sampler:
        """`sampler`, but every rank gets rank 0's tokens (a batch step's; cancels travel in BatchStep)."""
        group, is_root = self.group, self.group.rank() == 0

        def sample(logprobs: mx.array) -> mx.array:
            token = sampler(logprobs).astype(mx.int32)
            return mx.distributed.all_sum(token if is_root else mx.zeros_like(token), group=group)

        return sample

    def start(self, sampler: Sampler, wants_cancel: Callable[[], bool]) -> tuple[Sampler, Callable[[], bool]]:
        """(agreed sampler, agreed is_cancelled) for one generation. `wants_cancel` is read on rank 0 only."""
        group, is_root = self.group, self.group.rank() == 0
        latest: list[mx.array] = []  # the newest shared [token, cancel flag]

        def agreed(logprobs: mx.array) -> mx.array:
            token = sampler(logprobs).astype(mx.int32)
            flag = 1 if is_root and wants_cancel() else 0
            mine = mx.concatenate([token.reshape(-1), mx.array([flag], dtype=mx.int32)])
            shared = mx.distributed.all_sum(mine if is_root else mx.zeros_like(mine), group=group)
            latest[:] = [shared]  # read later: no evaluation here, while the previous step may still run
            return shared[:-1].reshape(token.shape)

        def cancelled() -> bool:
            # Called after each yielded token, when every rank has sampled the same next step.
            return bool(latest and latest[0][-1].item())

        return agreed, cancelled


class AgreedSamplers:
    """One agreed sampler per setting, the same object for the same setting on every rank:
    BatchGenerator samples in one call when a batch shares a sampler object and row by row
    otherwise, and every rank must make the same broadcasts. Forgets everything past `limit`
    settings, at the same moment on every rank: they see the same joins, and rank 0 takes a sampler
    only for a join that cannot fail to insert."""

    def __init__(self, lockstep: Lockstep, limit: int = 64) -> None:
        self._lockstep = lockstep
        self._limit = limit
        self._by_setting: dict[Sampling, Sampler] = {}

    def get(self, sampling: Sampling) -> Sampler:
        if sampling not in self._by_setting:
            if len(self._by_setting) >= self._limit:
                self._by_setting.clear()
            temperature, top_p, top_k, min_p = sampling
            self._by_setting[sampling] = self._lockstep.agreed(
                make_sampler(temp=temperature, top_p=top_p, top_k=top_k, min_p=min_p))
        return self._by_setting[sampling]

    def clear(self) -> None:
        self._by_setting.clear()
