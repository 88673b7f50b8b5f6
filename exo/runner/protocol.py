"""Messages between a worker and its runner subprocess: JSON lines on the runner's stdin/stdout."""

from __future__ import annotations

import msgspec

from exo.core.cache_reports import EMPTY, CacheContents
from exo.core.ids import TaskId
from exo.core.requests import GenerationParams
from exo.core.types import PromptCacheStats, SamplingDefaults
from exo.settings.services import NatsSecurity, RunnerSettings

# The variable that carries a runner's RunnerStart (JSON) from the worker to the runner process:
# in the child's environment, not on its command line, where `ps` would show the NATS password.
RUNNER_START_ENV = "EXO_RUNNER_START"


class RunnerStart(msgspec.Struct, frozen=True, kw_only=True):
    """What a runner process needs before its first request: where NATS is, how to log in, its settings."""

    nats_urls: list[str]
    security: NatsSecurity = NatsSecurity()
    settings: RunnerSettings = RunnerSettings()
    traces_endpoint: str = ""  # where the runner sends its spans, as its node does ("" : tracing off)
    # The node's key file (<data dir>/node.nk, its owner's only), never the seed itself: its chunks
    # are signed as `node_id` with it (exo/bus/chunk_signing.py). "": unsigned.
    node_id: str = ""
    node_key_file: str = ""


class Request(msgspec.Struct, frozen=True, kw_only=True, tag_field="op"):
    pass


class RankSetup(msgspec.Struct, frozen=True, kw_only=True):
    """This runner's place in a multi-node instance: its MLX ring group and its part of the model."""

    rank: int
    ring_hosts: list[str]  # "ip:port" of every rank, in rank order
    sharding: str  # "tensor" or "pipeline"
    start_layer: int = 0
    end_layer: int = 0


class Load(Request, frozen=True, tag="load", kw_only=True):
    model_path: str
    model_id: str = ""  # the instance's: a prefill split's peers check they serve the same one
    shard: RankSetup | None = None  # None: the whole model on this runner
    max_context: int = 0  # the instance's context (placement reserved its KV cache); 0: the model's
    kv_bits: int = 0  # the instance's KV cache quantized to this many bits; 0: not quantized
    draft_path: str = ""  # speculative decoding: the draft model's directory ("" : none)
    num_draft_tokens: int = 0
    adapter_path: str = ""  # a LoRA adapter's folder (mlx-lm's layout), applied to the model ("" : none)
    serve_prefills: bool = False  # a prefill instance's runner: serve prompts' KV caches (exo/runner/prefill_peer.py)


class WarmUp(Request, frozen=True, tag="warm_up", kw_only=True):
    pass


class Resume(msgspec.Struct, frozen=True, kw_only=True):
    """A generation taken over from a runner that died (a migration): what its stored chunks say."""

    token_ids: list[int]  # the tokens already streamed, in order: prefilled after the prompt
    next_index: int  # the index of the first chunk this runner sends
    attempt: int  # the task's run: len(task.migrations)


class PrefillPeer(msgspec.Struct, frozen=True, kw_only=True):
    """The prefill instance's runner that computes this generation's prompt cache (the master's choice)."""

    address: str  # "host:port"
    node_id: str
    public_key: str  # its node's key: the cache it sends is signed with it


class Generate(Request, frozen=True, tag="generate", kw_only=True):
    task_id: TaskId
    params: GenerationParams
    defaults: SamplingDefaults = SamplingDefaults()
    image_paths: dict[str, str] = {}  # sha256 -> file on this node, verified by the worker
    resume: Resume | None = None  # continue after these tokens instead of starting afresh
    traceparent: str = ""  # the worker's span that forwarded it (W3C): the runner's spans join its trace
    adapter_path: str = ""  # a LoRA adapter's folder, applied to this request's rows only (adapter_rows.py)
    prefill: PrefillPeer | None = None  # ask it for the prompt's KV cache first (None: prefill here)


class ExpectPrefill(Request, frozen=True, tag="expect_prefill", kw_only=True):
    """A prefill runner may serve this task's prompt cache, once, to this node's runner only."""

    task_id: TaskId
    asker: str  # the decoding instance's node
    asker_public_key: str


class Cancel(Request, frozen=True, tag="cancel", kw_only=True):
    task_id: TaskId


class Shutdown(Request, frozen=True, tag="shutdown", kw_only=True):
    pass


class Report(msgspec.Struct, frozen=True, kw_only=True, tag_field="op"):
    pass


class Loaded(Report, frozen=True, tag="loaded", kw_only=True, omit_defaults=True):
    prefill_port: int = 0  # where it serves prompts' KV caches (Load.serve_prefills); 0: it does not


class WarmedUp(Report, frozen=True, tag="warmed_up", kw_only=True):
    seconds: float = 0.0  # what the warm-up took (kernel compiles, mostly): the master's ready line says it


class Started(Report, frozen=True, tag="started", kw_only=True):
    task_id: TaskId


class Done(Report, frozen=True, tag="done", kw_only=True):
    task_id: TaskId
    finish_reason: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    cached_tokens: int = 0  # prompt tokens reused from the prompt cache
    prompt_cache: PromptCacheStats | None = None  # the runner's cache after this request
    audio_seconds: float = 0.0  # the speech a text-to-speech task generated


class Failed(Report, frozen=True, tag="failed", kw_only=True):
    error: str


class Alive(Report, frozen=True, tag="alive", kw_only=True):
    """Every second while the runner is idle or its model thread makes progress: a runner that
    has work and stops sending this is hung (exo/worker/plan.py)."""


class CacheHeld(Report, frozen=True, tag="cache_held", kw_only=True):
    """What the prompt cache holds, after it changed (at most twice a second: exo/runner/cache_contents.py):
    the worker passes rank 0's on to the master, whose routing reads it (exo/core/cache_reports.py)."""

    contents: CacheContents = EMPTY


AnyRequest = Load | WarmUp | Generate | ExpectPrefill | Cancel | Shutdown
AnyReport = Loaded | WarmedUp | Started | Done | Failed | Alive | CacheHeld

request_decoder = msgspec.json.Decoder(AnyRequest)
report_decoder = msgspec.json.Decoder(AnyReport)
encoder = msgspec.json.Encoder()


def encode_line(message: Request | Report) -> bytes:
    return encoder.encode(message) + b"\n"
