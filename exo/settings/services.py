"""Every setting of an exo node, one struct per service, each field with its variable and help.

exo/main.py reads them all once (flags, then the environment, then these defaults) and passes each
service its struct; no service reads the environment. `exo --help` and docs/operations.md list
exactly these (tests/test_settings.py keeps the docs equal to them).
"""

from __future__ import annotations

import os
from typing import Annotated

import msgspec
from msgspec import Meta

from exo.settings.declare import Env

Port = Meta(ge=0, le=65535)
NonNegative = Meta(ge=0)
Positive = Meta(gt=0)
AtLeastOne = Meta(ge=1)


class Frozen(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class NodeSettings(Frozen, frozen=True):
    """What the node runs and where: `exo` itself."""

    nats_url: Annotated[str, Env("EXO_NATS_URL", "NATS URL(s), comma-separated; none: start an embedded nats-server",
                                 flag="--nats", metavar="URL")] = ""
    nats_port: Annotated[int, Port, Env("EXO_NATS_PORT", "client port of the embedded nats-server; 0: any free "
                                        "port (if the default is taken and none was asked for, a free one is chosen)")] = 4222
    data_dir: Annotated[str, Env("EXO_HOME", "where this node keeps its id, models, custom cards and the embedded "
                                 "NATS store", flag="--data-dir", metavar="PATH")] = "~/.exo"
    api_host: Annotated[str, Env("EXO_API_HOST", "API listen address (none: 0.0.0.0, or 127.0.0.1 when the "
                                 "discovery address is a loopback address)", flag="--host", metavar="HOST")] = ""
    api_port: Annotated[int, Port, Env("EXO_API_PORT", "API and dashboard port (if the default is taken and none "
                                       "was asked for, the next free one is chosen)")] = 52415
    name: Annotated[str, Env("EXO_NODE_NAME", "what people call this node (none: the hostname, plus :API_PORT when "
                             "that is not the default)", flag="--name")] = ""
    log_level: Annotated[str, Meta(pattern="(?i)^(debug|info|warning|error)$"),
                         Env("EXO_LOG_LEVEL", "DEBUG, INFO, WARNING or ERROR")] = "INFO"
    log_format: Annotated[str, Meta(pattern="^(text|json)$"),
                          Env("EXO_LOG_FORMAT", "text, or json: one JSON object per line (time, level, logger, "
                              "node, message and the line's ids) for Loki, Elasticsearch or jq")] = "text"
    otlp_endpoint: Annotated[str, Env("EXO_OTLP_ENDPOINT", "send OpenTelemetry traces of every request to this OTLP/HTTP "
                                      "collector (a base URL: /v1/traces is added; none: OTEL_EXPORTER_OTLP_ENDPOINT, "
                                      "else tracing is off)", metavar="URL")] = ""
    run_master: Annotated[bool, Env("EXO_RUN_MASTER", "run a master on this node (--no-master: not)",
                                    flag="--master")] = True
    run_worker: Annotated[bool, Env("EXO_RUN_WORKER", "run models on this node (--no-worker: not)",
                                    flag="--worker")] = True
    run_api: Annotated[bool, Env("EXO_RUN_API", "serve the HTTP API (--no-api: not)", flag="--api")] = True


class NatsSecurity(Frozen, frozen=True):
    """How every exo process (runners and tools included) authenticates to NATS."""

    user: Annotated[str, Env("EXO_NATS_USER", "NATS user", flag="--nats-user")] = ""
    password: Annotated[str, Env("EXO_NATS_PASSWORD", "NATS password", flag="--nats-password")] = ""
    token: Annotated[str, Env("EXO_NATS_TOKEN", "NATS token", flag="--nats-token")] = ""
    user_credentials: Annotated[str, Env("EXO_NATS_CREDS", "NATS credentials file", flag="--nats-creds")] = ""
    tls_ca: Annotated[str, Env("EXO_NATS_TLS_CA", "CA file to verify the NATS server", flag="--nats-tls-ca")] = ""
    tls_cert: Annotated[str, Env("EXO_NATS_TLS_CERT", "client certificate for NATS", flag="--nats-tls-cert")] = ""
    tls_key: Annotated[str, Env("EXO_NATS_TLS_KEY", "key of the client certificate", flag="--nats-tls-key")] = ""


class BusSettings(Frozen, frozen=True):
    """The streams exo creates and the embedded nats-server it runs."""

    replicas: Annotated[Annotated[int, Meta(ge=1, le=5)] | None, Env("EXO_REPLICAS", "replicas of every stream and bucket when "
                                                           "they are created (3 on a 3-server NATS cluster)")] = None
    events_max_age_s: Annotated[Annotated[float, Positive] | None, Env("EXO_EVENTS_MAX_AGE_S", "seconds the event log keeps "
                                                             "events (applies when the stream is created)",
                                                             flag="--events-max-age")] = None
    events_max_bytes: Annotated[Annotated[int, Positive] | None, Env("EXO_EVENTS_MAX_BYTES", "bytes the event log keeps "
                                                           "(applies when the stream is created)")] = None
    cluster_forming_wait_s: Annotated[float, NonNegative, Env(
        "EXO_CLUSTER_FORMING_WAIT_S", "seconds to wait for a JetStream cluster that is still forming")] = 60.0
    nats_memory_limit: Annotated[str, Meta(pattern=r"^\d+(B|KiB|MiB|GiB|TiB)?$"), Env(
        "EXO_NATS_MEMORY_LIMIT", "soft memory limit of the embedded nats-server (its GOMEMLIMIT; a GOMEMLIMIT "
        "in the environment wins)", metavar="SIZE")] = "256MiB"


class ClusterSettings(Frozen, frozen=True):
    """Zero-config clustering: mDNS discovery and the NATS routes between nodes (off with --nats)."""

    discovery: Annotated[bool, Env("EXO_DISCOVERY", "look for other nodes and form a cluster with them "
                                   "(--no-discovery: a standalone embedded server)")] = True
    namespace: Annotated[str, Env("EXO_NAMESPACE", "only nodes of the same namespace form a cluster")] = "default"
    discovery_address: Annotated[str, Env("EXO_DISCOVERY_ADDRESS", "the address this node uses: mDNS, the cluster "
                                          "port, and the ring address of multi-node instances (none: the LAN "
                                          "address; EXO_ADVERTISE_ADDRESSES overrides the ring address)")] = ""
    cluster_port: Annotated[int, Port, Env("EXO_CLUSTER_PORT", "NATS cluster (route) port; 0: a free one, kept "
                                           "across restarts")] = 0
    cluster_secret: Annotated[str, Env("EXO_CLUSTER_SECRET", "password of the cluster routes, the same on every "
                                       "node; kept after the first use (none: trusted-LAN mode, named as a risk at "
                                       "start)")] = ""
    peer_remove_after_s: Annotated[float, NonNegative, Env(
        "EXO_PEER_REMOVE_AFTER_S", "seconds a cluster server may be silent before it is treated as gone for good: "
        "its stream replicas move to a spare server and it leaves the meta group (0: never)",
        flag="--peer-remove-after")] = 3600.0
    join: Annotated[str, Env("EXO_JOIN", "a member's cluster address (HOST:PORT, as its start banner prints it): "
                             "join that cluster as a full member, taking stream replicas, without mDNS", flag="--join",
                             metavar="HOST:PORT")] = ""
    join_token: Annotated[str, Env("EXO_JOIN_TOKEN", "a join token (`exo token create` on a member prints one): "
                                   "join that cluster with it; kept as the cluster secret after the first use "
                                   "(`exo join TOKEN` says the same)", flag="--join-token", metavar="TOKEN")] = ""
    join_timeout_s: Annotated[float, Positive, Env(
        "EXO_JOIN_TIMEOUT_S", "seconds a first join through announced routes may take before the node decides "
        "again without that cluster (a stale or spoofed announcement)", flag="--join-timeout")] = 60.0


class ModelSettings(Frozen, frozen=True):
    """Where models live and how they come: read by the worker (downloads) and the API (cards)."""

    models_dirs: Annotated[tuple[str, ...], Env("EXO_MODELS_DIRS", "directories models are downloaded to, "
                                                "os.pathsep-separated (none: DATA_DIR/models)",
                                                separator=os.pathsep, metavar="PATHS")] = ()
    models_read_only_dirs: Annotated[tuple[str, ...], Env("EXO_MODELS_READ_ONLY_DIRS", "directories with models "
                                                          "to use but never write (a shared disk, a Hub cache)",
                                                          separator=os.pathsep, metavar="PATHS")] = ()
    models_reserve_bytes: Annotated[int, NonNegative, Env("EXO_MODELS_RESERVE_BYTES", "free space a download "
                                                          "leaves on its disk")] = 0
    download_retries: Annotated[int, AtLeastOne, Env("EXO_DOWNLOAD_RETRIES", "attempts per file before a "
                                                     "download fails")] = 5
    offline: Annotated[bool, Env("EXO_OFFLINE", "use only complete models already in the model directories: no "
                                 "Hub, no peers (HF_HUB_OFFLINE=1 too)", aliases=("HF_HUB_OFFLINE",))] = False
    model_sharing: Annotated[bool, Env("EXO_MODEL_SHARING", "serve models to other nodes and fetch from them "
                                       "before the Hub")] = True


class MasterSettings(Frozen, frozen=True):
    """The master's snapshots, admission, routing and healing."""

    snapshot_every: Annotated[int, AtLeastOne, Env("EXO_SNAPSHOT_EVERY", "the master snapshots State to KV every "
                                                   "this many events...")] = 1000
    snapshot_interval_s: Annotated[float, Positive, Env("EXO_SNAPSHOT_INTERVAL", "...or every this many seconds, "
                                                        "whichever comes first", flag="--snapshot-interval")] = 30.0
    max_queue: Annotated[int, AtLeastOne, Env("EXO_MAX_QUEUE", "open requests an instance admits before answering "
                                              "429 (unless placed with its own)")] = 64
    node_timeout_s: Annotated[float, Positive, Env("EXO_NODE_TIMEOUT_S", "seconds without a heartbeat before the "
                                                   "master times a node out", flag="--node-timeout")] = 30.0
    suspect_s: Annotated[float, Positive, Env("EXO_SUSPECT_S", "seconds a node's pulses may stop before its "
                                              "generations move elsewhere (the worker holds them this long plus "
                                              "3 s)")] = 5.0
    migration_deadline_s: Annotated[float, Positive, Env("EXO_MIGRATION_DEADLINE_S", "seconds a moved request "
                                                         "waits for an instance of its model")] = 120.0
    max_migrations: Annotated[int, NonNegative, Env("EXO_MAX_MIGRATIONS", "moves per request; past them it ends "
                                                    "with the reason")] = 2
    on_demand: Annotated[bool, Env("EXO_ON_DEMAND", "a request for a model with no instance places one and "
                                   "waits for it (off: it is refused until someone places the model)")] = True
    load_timeout_s: Annotated[float, Positive, Env("EXO_LOAD_TIMEOUT_S", "seconds a request waits for an instance "
                                                   "of its model placed on demand")] = 300.0
    keep_alive_s: Annotated[float, Env("EXO_KEEP_ALIVE", "seconds a model placed on demand stays loaded without "
                                       "requests (negative: until deleted; a request's keep_alive overrides it)")] = 300.0
    scale_queue: Annotated[int, NonNegative, Env("EXO_SCALE_QUEUE", "pending requests per ready replica above which "
                                                 "a placement with max_replicas gets another one (0: no autoscaling)")] = 4
    scale_window_s: Annotated[float, NonNegative, Env("EXO_SCALE_WINDOW_S", "seconds the queue must stay above "
                                                      "EXO_SCALE_QUEUE before a replica is added, and between "
                                                      "scaling steps")] = 30.0
    scale_idle_s: Annotated[float, Positive, Env("EXO_SCALE_IDLE_S", "seconds without requests after which a "
                                                 "placement above its min_replicas loses a replica")] = 300.0
    cache_routing: Annotated[bool, Env("EXO_CACHE_ROUTING", "send a request to the instance that caches most of "
                                       "its prompt (off: the least busy one)")] = True
    adapters_share_base: Annotated[bool, Env("EXO_ADAPTERS_SHARE_BASE", "serve a request for \"<base>:<adapter>\" "
                                             "on a running single-node instance of its base, the adapter applied "
                                             "per row (off: each adapter needs an instance of its own)")] = True
    adapter_sweep_s: Annotated[float, NonNegative, Env("EXO_ADAPTER_SWEEP_S", "seconds between the leading master's "
                                                       "sweeps of adapter weights that no adapter names any more "
                                                       "(0: none)")] = 600.0
    adapter_sweep_grace_s: Annotated[float, NonNegative, Env("EXO_ADAPTER_SWEEP_GRACE_S", "how long ago unnamed "
                                                             "adapter weights must have been written before a sweep "
                                                             "deletes them (an upload's adapter may be on its "
                                                             "way)")] = 600.0
    term_renew_s: Annotated[float, Positive, Env("EXO_MASTER_TERM_RENEW_S", "seconds a master leads before it "
                                                 "elects itself again, so that the event log always holds an "
                                                 "election younger than its retention (EXO_EVENTS keeps 30 days): "
                                                 "a starting node can check who signed the snapshot")] = 7 * 86400.0
    cache_reports: Annotated[bool, Env("EXO_CACHE_REPORTS", "route by what runners report their prompt caches "
                                       "hold, so an evicted conversation attracts nothing (off: by the tasks "
                                       "in State alone)")] = True
    groups: Annotated[str, Env("EXO_MASTER_GROUPS", "master groups, each deciding its models' requests with a log, "
                               "lease and master of its own: NAME=GLOB,... (a group's globs joined by a vertical bar; "
                               "docs/scaling.md); the shared master writes its map to the log: give every master "
                               "candidate the same")] = ""
    lead_groups: Annotated[str, Env("EXO_LEAD_GROUPS", "the master groups this node campaigns to lead, by name "
                                    "(comma-separated; empty: every group)")] = ""

    lead_shared: Annotated[bool, Env("EXO_LEAD_SHARED", "campaign to lead the shared log too (off: a node that leads "
                                     "master groups only, and hears no node's pulses)")] = True

    def leads_group(self, group: str) -> bool:
        return not self.lead_groups.strip() or group in {g.strip() for g in self.lead_groups.split(",")}


class WorkerSettings(Frozen, frozen=True):
    """The worker's beats, its runners' supervision and its caches."""

    heartbeat_s: Annotated[float, Positive, Env("EXO_HEARTBEAT_S", "seconds between a worker's heartbeats (free "
                                                "memory, downloads)")] = 5.0
    pulse_s: Annotated[float, Positive, Env("EXO_PULSE_S", "seconds between a worker's pulses (the master's "
                                            "liveness signal)")] = 1.0
    runner_stall_s: Annotated[float, Positive, Env("EXO_RUNNER_STALL_S", "seconds a runner with work may be silent "
                                                   "before it is taken for hung and restarted")] = 30.0
    image_cache_bytes: Annotated[int, NonNegative, Env("EXO_IMAGE_CACHE_BYTES", "bytes of request images a worker "
                                                       "keeps on disk")] = 1 << 30
    adapter_cache_bytes: Annotated[int, NonNegative, Env("EXO_ADAPTER_CACHE_BYTES", "bytes of LoRA adapters a worker "
                                                         "keeps on disk (those its runners use stay)")] = 4 << 30
    advertise_addresses: Annotated[tuple[str, ...], Env("EXO_ADVERTISE_ADDRESSES", "addresses peers dial for the "
                                                        "ring of a multi-node instance, comma-separated (none: the "
                                                        "discovery address)", metavar="ADDRESSES")] = ()
    ring_ports: Annotated[str, Meta(pattern=r"^(\d{1,5}(-\d{1,5})?)?$"), Env(
        "EXO_RING_PORTS", "ports for the rings of multi-node instances, FIRST-LAST (none: 52600-52699)",
        metavar="FIRST-LAST")] = ""


class RunnerSettings(Frozen, frozen=True):
    """How a runner serves its model; the worker hands them to each runner process it starts."""

    max_batch: Annotated[int, AtLeastOne, Env("EXO_MAX_BATCH", "requests that decode together; 1 turns batching "
                                              "off (as mlx_lm.server's --decode-concurrency)")] = 32
    stream_interval_ms: Annotated[float, NonNegative, Env("EXO_STREAM_INTERVAL_MS", "milliseconds a runner gathers "
                                                          "tokens into one chunk")] = 20.0
    prompt_cache_bytes: Annotated[Annotated[int, NonNegative] | None, Env("EXO_PROMPT_CACHE_BYTES", "bytes of prompt cache per "
                                                               "instance; 0: off (none: a quarter of the memory "
                                                               "free at load)")] = None
    prompt_cache_entries: Annotated[int, AtLeastOne, Env("EXO_PROMPT_CACHE_ENTRIES", "prompts cached per instance "
                                                         "(as mlx_lm.server's --prompt-cache-size)")] = 10
    resident_adapters: Annotated[int, AtLeastOne, Env("EXO_RESIDENT_ADAPTERS", "LoRA adapters an instance of a "
                                                      "base keeps loaded beside it (least recently used out, never "
                                                      "one a running request uses)")] = 8
    vision_cache_images: Annotated[int, NonNegative, Env("EXO_VISION_CACHE_IMAGES", "images whose vision features "
                                                         "a vision instance keeps")] = 8
    ring_join_timeout_s: Annotated[float, Positive, Env("EXO_RING_JOIN_TIMEOUT_S", "seconds a multi-node instance's "
                                                        "ring may take to form before its runner exits to retry")] = 60.0
    prefill_timeout_s: Annotated[float, Positive, Env("EXO_PREFILL_TIMEOUT_S", "seconds a decode instance's runner "
                                                      "waits for a prefill instance's runner to send a prompt's KV "
                                                      "cache (prefill included) before it prefills alone")] = 120.0


class ApiSettings(Frozen, frozen=True):
    """The HTTP API's keys and limits."""

    api_keys: Annotated[tuple[str, ...], Env("EXO_API_KEYS", "require one of these API keys, comma-separated (the "
                                             "flag is repeatable and adds to them)", flag="--api-key",
                                             metavar="KEY", repeatable=True)] = ()
    resume_grace_s: Annotated[float, NonNegative, Env("EXO_RESUME_GRACE_S", "seconds a dropped stream may be "
                                                      "resumed before its generation is cancelled (0: at "
                                                      "once)")] = 5.0
    loading_note_s: Annotated[float, Positive, Env("EXO_LOADING_NOTE_S", "seconds between the SSE comments that "
                                                   "tell a streaming client its model is still loading")] = 5.0
    # The master's EXO_LOAD_TIMEOUT_S, handed on by exo/node.py: a request waits this long for its
    # model's instance to be ready, however it waits (for a placement, or for a loading instance).
    load_timeout_s: float = 300.0
    max_body_bytes: Annotated[Annotated[int, Positive] | None, Env("EXO_MAX_BODY_BYTES", "largest request body "
                                                                   "(none: what one NATS message carries, the "
                                                                   "server's max_payload less 64 KiB; images ride "
                                                                   "in bodies, base64)")] = None
    max_tokens_limit: Annotated[int, Positive, Env("EXO_MAX_TOKENS_LIMIT", "most tokens a request may ask "
                                                   "for")] = 32768
    max_image_bytes: Annotated[int, Positive, Env("EXO_MAX_IMAGE_BYTES", "largest image")] = 20 * 1024 * 1024
    max_audio_bytes: Annotated[int, Positive, Env("EXO_MAX_AUDIO_BYTES", "largest audio file to transcribe (OpenAI's "
                                                  "limit)")] = 25 * 1024 * 1024
    max_audio_seconds: Annotated[float, Positive, Env("EXO_MAX_AUDIO_SECONDS", "longest audio to transcribe, in "
                                                      "seconds")] = 1500.0
    max_speech_chars: Annotated[int, Positive, Env("EXO_MAX_SPEECH_CHARS", "longest text to speak, in characters "
                                                   "(OpenAI's limit)")] = 4096
    max_adapter_bytes: Annotated[int, Positive, Env("EXO_MAX_ADAPTER_BYTES", "largest LoRA adapter "
                                                     "(adapters.safetensors) POST /adapters takes")] = 1 << 30
    metrics_per_key: Annotated[bool, Env("EXO_METRICS_PER_KEY", "label /metrics' usage counters by API key id (off: "
                                         "summed over keys, for clusters with many keys)")] = True
    metrics_history_s: Annotated[float, Positive, Env("EXO_METRICS_HISTORY_S", "seconds between the samples of "
                                                      "GET /metrics/history, the dashboard's plots (360 "
                                                      "kept)")] = 10.0
    max_images: Annotated[int, NonNegative, Env("EXO_MAX_IMAGES", "images per request")] = 16
    max_request_image_bytes: Annotated[int, Positive, Env("EXO_MAX_REQUEST_IMAGE_BYTES", "bytes of images per "
                                                          "request")] = 64 * 1024 * 1024
    max_image_pixels: Annotated[int, Positive, Env("EXO_MAX_IMAGE_PIXELS", "most pixels of one "
                                                   "image")] = 4096 * 4096
    image_url_private: Annotated[bool, Env("EXO_IMAGE_URL_PRIVATE", "let image URLs reach loopback, link-local and "
                                           "private addresses (off: refused, so a client cannot make the API node "
                                           "read its own network)")] = False
    image_url_timeout_s: Annotated[float, Positive, Env("EXO_IMAGE_URL_TIMEOUT_S", "seconds the API node may take to "
                                                        "fetch one image URL, redirects included")] = 10.0
    access_log: Annotated[bool, Env("EXO_ACCESS_LOG", "one INFO line per HTTP request (off: those lines are "
                                    "DEBUG)")] = False


class ResourceSettings(Frozen, frozen=True):
    """The folders that ship beside the code (for packagers: found in a checkout or a wheel by themselves)."""

    streams_dir: Annotated[str, Env("EXO_STREAMS_DIR", "stream, KV and object-store definitions (JSON)",
                                    flag="")] = ""
    cards_dir: Annotated[str, Env("EXO_CARDS_DIR", "built-in model cards (TOML)", flag="")] = ""


class ToolSettings(Frozen, frozen=True):
    """The operator tools' own (`exo inspect` ...; they also read EXO_NATS_URL, EXO_HOME and the NATS security)."""

    nats_monitor_url: Annotated[str, Env("EXO_NATS_MONITOR_URL", "the NATS server's HTTP monitoring URL for `exo "
                                         "inspect`, e.g. http://127.0.0.1:8222", flag="")] = ""
    api_key: Annotated[str, Env("EXO_API_KEY", "the admin API key `exo keys` sends (its --key)", flag="")] = ""


# In the order --help and docs/operations.md show them.
SERVICE_SETTINGS: tuple[type[Frozen], ...] = (
    NodeSettings, NatsSecurity, BusSettings, ClusterSettings, ModelSettings, MasterSettings, WorkerSettings,
    RunnerSettings, ApiSettings, ResourceSettings, ToolSettings,
)
