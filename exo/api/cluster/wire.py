"""Wire types of the cluster's own routes (placement, instances, cards, downloads).

Bodies as msgspec decodes them: unknown fields are ignored on the surfaces (as their own servers
do) and forbidden on the cluster's routes; the handler modules validate the values."""

from __future__ import annotations

import msgspec

from exo.core.ids import ModelId, NodeId, RunnerId
from exo.core.types import InstanceRole, Sharding


class PlaceInstanceRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model_id: ModelId
    sharding: Sharding = "pipeline"
    min_nodes: int = 1
    max_queue: int = 0  # open tasks admitted before 429s; 0: the master's default
    max_context: int = 0  # tokens of context to reserve KV cache for; 0: the most that fits, up to a default
    kv_bits: int = 0  # quantize the instance's KV cache (2-8 bits); 0: not quantized
    wait: bool | float | None = None  # answer once the instance is ready or failed (seconds, or true)
    force: bool = False  # place without checking that it fits in memory (a card of unknown size, too)
    replicas: int = 1  # instances kept running (a desire: replaced when one dies), on distinct nodes where memory allows
    # The load scales replicas between these (0: it may unload entirely); absent: replicas (fixed).
    min_replicas: int | None = None
    max_replicas: int | None = None
    draft_model: ModelId = ModelId("")  # speculative decoding: a smaller model of the same vocabulary (one node)
    num_draft_tokens: int = 0  # tokens the draft proposes per step; 0: 3 (mlx_lm.server's default)
    keep_alive: str | int | float | None = None  # unloaded after this long without requests; absent: until deleted
    role: InstanceRole = "both"  # "prefill" or "decode": half of a prefill/decode split (docs/multinode.md)


class DownloadReport(msgspec.Struct, frozen=True, kw_only=True):
    """The runner's node's download of the instance's model, from State.downloads."""

    status: str
    done_bytes: int
    total_bytes: int
    speed_bps: float
    eta_s: float | None
    source: str
    error_code: str
    error: str


class RunnerReport(msgspec.Struct, frozen=True, kw_only=True):
    runner_id: RunnerId
    node_id: NodeId
    rank: int
    status: str
    error: str
    download: DownloadReport | None
    failures: int = 0  # failures since it was last ready: the worker restarts it with back-off, up to a bound


class InstanceReport(msgspec.Struct, frozen=True, kw_only=True):
    """How far an instance is: "failed" if a runner failed, "stopped" if one stopped, "ready" when
    every runner is, else its least advanced runner's status. `error_code` is the download's
    code (a DownloadErrorCode) when a download failed the runner, else "runner_failed"."""

    status: str
    error: str = ""
    error_code: str = ""
    runners: list[RunnerReport] = []

    @property
    def failed_runner(self) -> RunnerReport | None:
        return next((r for r in self.runners if r.status == "failed"), None)


class DownloadBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model_id: ModelId
    node_id: NodeId = NodeId("")  # empty: the node serving this API
