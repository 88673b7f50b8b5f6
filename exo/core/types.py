"""Plain data shared by every part of exo: model cards, shards, instances, runners, tasks.
What a request asks and what comes back (GenerationParams, TokenChunk) is in exo/core/requests.py.

Everything here is a msgspec Struct so it encodes to readable JSON on the wire and
in snapshots. New fields must get defaults so older logs keep decoding.
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

from exo.core.ids import CommandId, InstanceId, ModelId, NodeId, RunnerId, TaskId
from exo.core.requests import GenerationParams

Sharding = Literal["pipeline", "tensor"]
InstanceRole = Literal["both", "prefill", "decode"]
RunnerStatus = Literal[
    "created", "downloading", "downloaded", "loading", "warming_up", "ready", "failed", "stopped"
]
TaskStatus = Literal["pending", "running", "completed", "cancelled", "failed"]
RejectionCode = Literal["invalid", "not_found", "conflict", "unavailable", "overloaded", "rate_limited", "unauthorized"]
DownloadStatus = Literal["pending", "downloading", "completed", "failed", "cancelled"]
# Why a download failed, for programs; the event's reason says it for people.
DownloadErrorCode = Literal[
    "not_found", "gated", "unauthorized", "disk_full", "network", "rate_limited", "corrupt", "offline", "io", "unknown"
]

# A model id is a Hugging Face style "org/name" (or a bare "name"): no path tricks.
# fullmatch, not match with "$": "$" also matches before a trailing newline.
_MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")


def is_valid_model_id(model_id: str) -> bool:
    return bool(_MODEL_ID.fullmatch(model_id)) and ".." not in model_id


class SamplingDefaults(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0: off
    min_p: float | None = None

    def problem(self) -> str | None:
        """The ranges a request may ask for (OpenAI's): defaults must be values a request could give."""
        if self.temperature is not None and not 0 <= self.temperature <= 2:
            return f"temperature must be between 0 and 2, not {self.temperature}"
        if self.top_p is not None and not 0 <= self.top_p <= 1:
            return f"top_p must be between 0 and 1, not {self.top_p}"
        if self.top_k is not None and self.top_k < 0:
            return f"top_k must be 0 (off) or more, not {self.top_k}"
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            return f"min_p must be between 0 and 1, not {self.min_p}"
        return None


# The most any real model has, with room to spare: a card beyond these is a typo or an attack
# (n_layers 10^30 was placed as a shard ending at layer 10^30).
CARD_LIMITS = {"n_layers": 4096, "hidden_size": 1 << 20, "num_attention_heads": 1 << 16,
               "num_key_value_heads": 1 << 16, "head_dim": 1 << 16, "context_length": 1 << 27,
               "storage_bytes": 1 << 50}


Pooling = Literal["mean", "cls", "lasttoken"]
ScoreActivation = Literal["sigmoid", "identity"]


class EmbeddingSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How an embedding model turns its last hidden states into one vector per input: as its
    sentence-transformers files say (exo/core/embedding_files.py)."""

    pooling: Pooling = "mean"
    normalize: bool = True  # L2, as sentence-transformers' Normalize module
    # Set: a cross-encoder (a sequence classifier with one label) that scores (query, document) pairs for
    # POST /v1/rerank, this activation on its logit; pooling and normalize do not apply. Placed as embedders are.
    rerank: ScoreActivation | None = None


class ModelCard(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What exo needs to know about a model before it downloads a single byte."""

    model_id: ModelId
    name: str = ""
    repo_id: str = ""  # Hugging Face repo; empty means the same as model_id
    revision: str = "main"
    path: str = ""  # an absolute local model directory, used instead of downloading
    n_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    storage_bytes: int = 0
    context_length: int = 0
    head_dim: int = 0  # 0: hidden_size / num_attention_heads (models that differ say so in their config)
    kv_dtype_bytes: int = 0  # bytes per KV cache element (4: float32 models); 0: 2, as float16 / bfloat16
    supports_images: bool = False
    sampling: SamplingDefaults = SamplingDefaults()
    sampling_no_thinking: SamplingDefaults | None = None  # for requests that turn a thinking model's thinking off
    embedding: EmbeddingSpec | None = None  # set: the model embeds (POST /v1/embeddings), it does not chat
    transcribes: bool = False  # a speech-to-text model (Whisper): POST /v1/audio/transcriptions, it does not chat
    speaks: bool = False  # a text-to-speech model (an mlx-audio TTS family): POST /v1/audio/speech, it does not chat
    on_demand: bool = True  # a request for it with no instance places one (False: only POST /place_instance does)

    @property
    def source_repo(self) -> str:
        return self.repo_id or self.model_id

    def sampling_for(self, enable_thinking: bool | None) -> SamplingDefaults:
        """The defaults for a request: thinking models often want other ones when they do not think."""
        if enable_thinking is False and self.sampling_no_thinking is not None:
            return self.sampling_no_thinking
        return self.sampling

    def problem(self) -> str | None:
        """Why this card cannot be served or stored (None: it can). Checked by the master before it
        adds a card and by the reducer before it folds one, so State never holds a card that a
        worker cannot write to disk or plan from."""
        if not is_valid_model_id(self.model_id):
            return f"invalid model id {self.model_id!r}"
        if self.repo_id and not is_valid_model_id(self.repo_id):
            return f"invalid repo id {self.repo_id!r}"
        if self.path and not self.path.startswith("/"):
            return f"path must be absolute, not {self.path!r}"
        sizes = {"n_layers": self.n_layers, "hidden_size": self.hidden_size, "storage_bytes": self.storage_bytes,
                 "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
                 "context_length": self.context_length, "head_dim": self.head_dim, "kv_dtype_bytes": self.kv_dtype_bytes}
        negative = [name for name, value in sizes.items() if value < 0]
        if negative:
            return f"{', '.join(negative)} must not be negative"
        too_big = [f"{name} {sizes[name]} is over {limit}" for name, limit in CARD_LIMITS.items() if sizes[name] > limit]
        if too_big:
            return "; ".join(too_big)
        if self.kv_dtype_bytes not in (0, 1, 2, 4, 8):
            return f"kv_dtype_bytes must be 0 (2, the default), 1, 2, 4 or 8, not {self.kv_dtype_bytes}"
        for name, defaults in (("sampling", self.sampling), ("sampling_no_thinking", self.sampling_no_thinking)):
            if defaults is not None and (problem := defaults.problem()):
                return f"{name}.{problem}"
        return None


class ShardAssignment(msgspec.Struct, frozen=True, kw_only=True):
    """One rank of an instance: which node runs it and which layers it holds."""

    runner_id: RunnerId
    node_id: NodeId
    rank: int = 0
    world_size: int = 1
    start_layer: int = 0
    end_layer: int = 0  # exclusive
    # "ip:port" this rank listens on for the MLX ring group; "" for a one-node instance.
    ring_address: str = ""
    memory_bytes: int = 0  # what placement counted this rank's part of the weights to take (0: unknown)
    kv_bytes: int = 0  # what it reserved on this rank for the instance's max_context of KV cache (0: unknown)


class Instance(msgspec.Struct, frozen=True, kw_only=True):
    instance_id: InstanceId
    model_id: ModelId
    sharding: Sharding = "pipeline"
    shards: list[ShardAssignment] = []
    created_seq: int = 0  # stream sequence of its creation: a stable order for routing
    max_queue: int = 0  # open tasks it admits; 0: the master's default
    max_context: int = 0  # tokens of context (prompt + answer) it has room for; 0: as the model allows
    kv_bits: int = 0  # its KV cache quantized to this many bits (mlx-lm's quantized cache); 0: not quantized
    command_id: CommandId = CommandId("")  # the command that placed it: a retried Idempotency-Key finds it by this
    desire_id: str = ""  # the Desire it serves (exo/master/heal.py keeps it placed); "": none (logs before #29)
    # Speculative decoding: a smaller model of the same vocabulary proposes this many tokens per step.
    draft_model: ModelId = ModelId("")
    num_draft_tokens: int = 0
    # Prefill on one instance, decode on another (docs/multinode.md): "prefill" instances take a
    # request's prompt, "decode" ones its answer; "both" (every instance before roles) does both.
    role: InstanceRole = "both"


class Desire(msgspec.Struct, frozen=True, kw_only=True):
    """A placement kept in force: the master keeps `replicas` instances of it running, placing a
    replacement when one fails for good or loses a node (exo/master/heal.py)."""

    desire_id: str  # the command id of the place_instance that made it
    model_id: ModelId
    sharding: Sharding = "pipeline"
    min_nodes: int = 1
    max_queue: int = 0
    max_context: int = 0
    kv_bits: int = 0
    force: bool = False
    replicas: int = 1
    waiting: str = ""  # why it has fewer instances than replicas right now ("" : it has them, or is placing)
    failures: int = 0  # its instances ended for failing since one last became ready: the back-off grows with it
    retry_at: float = 0.0  # wall clock: no replacement before this (back-off after failures)
    draft_model: ModelId = ModelId("")  # speculative decoding's draft, as Instance's
    num_draft_tokens: int = 0
    on_demand: bool = False  # placed by a request for a model with no instance, not by POST /place_instance
    # Seconds without requests after which the master unloads it (negative: never, as Ollama's keep_alive).
    keep_alive_s: float = -1.0
    role: InstanceRole = "both"  # what its instances do (Instance.role)
    last_used_at: float = 0.0  # wall clock: its latest task's creation or end (the reducer's); 0: never stamped
    # Bounds the master scales `replicas` within, following the load (exo/master/autoscale.py); None: replicas.
    min_replicas: int | None = None
    max_replicas: int | None = None
    pressure_since: float = 0.0  # wall clock: its queue went above the target (0: it is not)
    last_scaled_at: float = 0.0  # wall clock of its latest scaling step: the next waits a window


class Migration(msgspec.Struct, frozen=True, kw_only=True):
    """A task moved off an instance that died: it continues on `to_instance` from the tokens streamed."""

    from_instance: InstanceId
    to_instance: InstanceId = InstanceId("")  # "": waiting for an instance of its model
    reason: str = ""
    at: float = 0.0  # wall clock


class RunnerInfo(msgspec.Struct, frozen=True, kw_only=True):
    runner_id: RunnerId
    instance_id: InstanceId
    node_id: NodeId
    status: RunnerStatus = "created"
    error: str = ""
    failures: int = 0  # failures since the runner was last ready; the master deletes the instance past a bound
    prefill_address: str = ""  # "host:port" a prefill instance's runner serves prompts' KV caches on ("" : none)


class PromptCacheStats(msgspec.Struct, frozen=True, kw_only=True):
    """One runner's prompt cache (exo/runner/prompt_cache.py); counters since the runner started."""

    hits: int = 0  # requests that reused a cached prefix
    misses: int = 0
    tokens_reused: int = 0  # prompt tokens not processed again
    bytes: int = 0  # KV bytes held now
    entries: int = 0
    evictions: int = 0  # entries dropped to stay within the byte or entry limit


class NodeInfo(msgspec.Struct, frozen=True, kw_only=True):
    node_id: NodeId
    hostname: str = ""
    name: str = ""  # what people call it: --name, else hostname (plus the API port when not the default)
    memory_total: int = 0
    memory_available: int = 0
    cpu_count: int = 0
    backend: str = ""  # MLX backend: "cpu", "metal" or "cuda"
    last_seen: float = 0.0  # the node's clock at its latest heartbeat
    addresses: list[str] = []  # IPs peers can reach it on, best first
    ring_port_first: int = 0  # ports it lets MLX ring groups listen on: [first, first + count)
    ring_port_count: int = 0
    incarnation: str = ""  # random per process start: two live processes with one node id show up as two
    prompt_caches: dict[InstanceId, PromptCacheStats] = {}  # instance id -> its runner's prompt cache on this node
    suspect_since: float = 0.0  # the master's wall clock when it marked the node suspect (0: not); only it sets this
    # Its chunk-signing key (a NATS user nkey, "U..."; exo/bus/chunk_signing.py): the first one State
    # sees stays (trust on first use); "": a node from before keys.
    public_key: str = ""
    offline: bool = False  # --offline: it fetches no model (from the Hub or peers), it uses only what is on its disks
    # Set by the reducer once one of its events was signed with public_key: every later one must be.
    signs_events: bool = False


class FileProgress(msgspec.Struct, frozen=True, kw_only=True):
    path: str  # relative to the model directory
    done: int = 0  # bytes on disk (verified or partial)
    total: int = 0


class DownloadProgress(msgspec.Struct, frozen=True, kw_only=True):
    """One model on one node: what State.downloads[node_id][model_id] holds."""

    node_id: NodeId
    model_id: ModelId
    status: DownloadStatus = "pending"
    done_bytes: int = 0  # of the files this node needs (its shard's weights, config, tokenizer)
    total_bytes: int = 0
    speed_bps: float = 0.0  # bytes per second over the last few seconds
    eta_s: float | None = None  # None while the speed is unknown
    files: list[FileProgress] = []
    source: str = ""  # "hub", "peer:<node id>" or "local" (already on disk)
    path: str = ""  # the model directory on that node
    error_code: str = ""  # a DownloadErrorCode when status is "failed"
    error: str = ""
    updated_at: float = 0.0  # the node's clock (time.time()) when it reported this


class ConversationDigest(msgspec.Struct, frozen=True, kw_only=True):
    """A request's prompt by digest (exo/core/conversation.py): what routing compares."""

    roles: list[str] = []
    messages: list[str] = []  # a digest of each message (role, content, images)
    chars: list[int] = []  # each message's content length + 1: how much a shared message is worth
    tools: str = ""  # digest of the tool definitions, "" with none
    prompt_chars: int = -1  # a raw prompt's (completions) length; -1: a chat
    prompt: str = ""


class Task(msgspec.Struct, frozen=True, kw_only=True):
    task_id: TaskId  # equals the command id that asked for it, so the caller can find it
    instance_id: InstanceId
    model_id: ModelId
    params: GenerationParams = GenerationParams()
    status: TaskStatus = "pending"
    cancel_requested: bool = False
    cancel_reason: str = ""  # why it was asked to cancel, when not by its client ("": by its client)
    created_at: float = 0.0
    finish_reason: str = ""
    error: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the runner's prompt cache
    migrations: list[Migration] = []  # its moves to other instances, oldest first: its run is len(migrations)
    key_id: str = ""  # the API key that asked for it (exo/core/keys.py); "": none (no keys, or an admin's from the env)
    priority: str = "interactive"  # "batch": served after interactive requests (a Tier)
    # Set by the reducer: the prompt by digest. Once the task finishes, `params` loses its
    # messages, prompt, tools and stop strings, and this is what routing reads of it.
    conversation: ConversationDigest = ConversationDigest()
    # Set by the reducer: the nodes of each run's instance, by run (attempt), when it began: who may
    # sign its chunks, still known once a migrated run's instance is deleted. []: not known (an older log).
    run_nodes: list[list[NodeId]] = []
    # A prefill instance that computes its prompt's KV cache for its (decode) instance's first run ("" : none).
    prefill_instance: InstanceId = InstanceId("")
    # Why a split model's request decodes on a prefill instance, alone ("" : it does not): the fallback, in its event.
    split_note: str = ""


class ClusterServer(msgspec.Struct, frozen=True, kw_only=True):
    """One nats-server of a discovered cluster, as the meta leader sees it."""

    name: str
    online: bool = True


class StreamPlacement(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    replicas: int = 1
    leader: str = ""
    followers: list[str] = []


class ClusterLayout(msgspec.Struct, frozen=True, kw_only=True):
    """The JetStream cluster under exo: its servers, meta leader and where each stream lives.
    Empty for a standalone server or one exo does not run."""

    name: str = ""
    meta_leader: str = ""
    servers: list[ClusterServer] = []
    streams: list[StreamPlacement] = []
