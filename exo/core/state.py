"""The one State every node folds the event log into."""

from __future__ import annotations

import msgspec

from exo.core.adapters import Adapter
from exo.core.ids import CommandId, InstanceId, ModelId, NodeId, RunnerId, TaskId
from exo.core.join_tokens import JoinToken
from exo.core.keys import ApiKey, KeyWindow
from exo.core.requests import rows_of
from exo.core.types import ClusterLayout, Desire, DownloadProgress, Instance, ModelCard, NodeInfo, RunnerInfo, Task
from exo.core.usage import UsageByDay, UsageCounts

MAX_SKIPPED_KEPT = 100
MAX_FINISHED_TASKS = 1000
MAX_ANSWERED_COMMANDS = 1024


MAX_REVOKED_NODES = 1000  # removed nodes State remembers; past that the oldest is forgotten (it could register again)


class RevokedNode(msgspec.Struct, frozen=True, kw_only=True):
    """A node an admin removed (NodeRemoved): what it may no longer do is in exo/core/revocation.py."""

    public_key: str = ""  # its key when removed: still verifies the chunks of runs it ran before
    seq: int = 0  # the node.removed event's sequence
    reason: str = ""
    removed_by: str = ""


class SkippedEvent(msgspec.Struct, frozen=True, kw_only=True):
    seq: int
    reason: str


class State(msgspec.Struct, frozen=True, kw_only=True):
    last_seq: int = 0  # stream sequence of the last event folded in
    leader_term: int = 0
    leader_node: str = ""
    leader_by_sequence: bool = False  # the leader's term is its election's sequence (see LeaderElected)
    leader_key: str = ""  # the key that signed the current term's election: its master's events need it ("": none)
    nodes: dict[NodeId, NodeInfo] = {}
    instances: dict[InstanceId, Instance] = {}
    runners: dict[RunnerId, RunnerInfo] = {}
    tasks: dict[TaskId, Task] = {}
    custom_model_cards: dict[ModelId, ModelCard] = {}
    skipped_events: list[SkippedEvent] = []  # the most recent events the reducer could not use
    finished_task_ids: list[TaskId] = []  # oldest first; bounds how many finished tasks State keeps
    # The most recent commands the log already answers (command id -> sequence): a command
    # redelivered to a new master after its first master died is not decided twice.
    answered_commands: dict[CommandId, int] = {}
    downloads: dict[NodeId, dict[ModelId, DownloadProgress]] = {}  # node id -> model id -> latest progress
    # model id -> why its most recently deleted instance went away: a 503 says it to callers.
    instance_end_reasons: dict[ModelId, str] = {}
    cluster: ClusterLayout = ClusterLayout()  # a discovered cluster's servers and replicas
    desires: dict[str, Desire] = {}  # desire id -> the placement the master keeps running (exo/master/heal.py)
    migrations_total: int = 0  # tasks moved off a dead instance, ever (/metrics)
    adapters: dict[str, Adapter] = {}  # LoRA adapters by name (exo/core/adapters.py)
    api_keys: dict[str, ApiKey] = {}  # by key id (exo/core/keys.py): hashed, never the secret
    key_windows: dict[str, KeyWindow] = {}  # by key id: what its per-minute limits count in
    usage: UsageByDay = {}  # key id -> UTC day -> model id -> counts (exo/core/usage.py)
    usage_totals: dict[str, dict[str, UsageCounts]] = {}  # key id -> model id -> counts since the key began
    # Master groups (exo/core/groups.py). `group`: the log this State folds ("" the shared one).
    # In the shared log only: the group map (group -> model-id globs) and every group ever in it,
    # whose logs nodes follow (a group's tasks in flight finish there after a model moves).
    group: str = ""
    groups: dict[str, list[str]] = {}
    group_logs: list[str] = []
    revoked_nodes: dict[NodeId, RevokedNode] = {}  # node id -> its removal, oldest first (MAX_REVOKED_NODES)
    join_tokens: dict[str, JoinToken] = {}  # by token id, oldest first: digests only (exo/core/join_tokens.py)

    def open_rows_of_key(self, key_id: str) -> int:
        """The batch rows the key's open tasks decode: a task of n choices counts n."""
        return sum(rows_of(t.params) for t in self.tasks.values() if t.key_id == key_id
                   and t.status in ("pending", "running"))

    def max_context_of(self, model_id: ModelId) -> int:
        """The most context any instance of the model has room for (0: none placed, or unknown)."""
        return max((i.max_context for i in self.instances.values() if i.model_id == model_id), default=0)

    def instances_of(self, model_id: ModelId) -> list[Instance]:
        return sorted((i for i in self.instances.values() if i.model_id == model_id), key=_placed_order)

    def is_ready(self, instance: Instance) -> bool:
        """Every runner of the instance is ready: it serves requests."""
        return bool(instance.shards) and all(
            (runner := self.runners.get(s.runner_id)) is not None and runner.status == "ready" for s in instance.shards)

    def instances_of_desire(self, desire_id: str) -> list[Instance]:
        return sorted((i for i in self.instances.values() if i.desire_id == desire_id), key=_placed_order)

    def download_of(self, node_id: NodeId, model_id: ModelId) -> DownloadProgress | None:
        return self.downloads.get(node_id, {}).get(model_id)

    def open_tasks_of(self, instance_id: InstanceId) -> list[Task]:
        return self.open_tasks_by_instance().get(instance_id, [])

    def open_tasks_by_instance(self) -> dict[InstanceId, list[Task]]:
        """Every pending or running task, by instance, oldest first: one pass over `tasks` (which
        keeps the last 1,000 finished ones too), however many instances the caller asks about."""
        found: dict[InstanceId, list[Task]] = {}
        for task in self.tasks.values():
            if task.status == "pending" or task.status == "running":
                found.setdefault(task.instance_id, []).append(task)
        return found


def _placed_order(instance: Instance) -> tuple[int, str]:
    return instance.created_seq, instance.instance_id


_state_encoder = msgspec.json.Encoder()
_state_decoder = msgspec.json.Decoder(State)


def encode_state(state: State) -> bytes:
    return _state_encoder.encode(state)


def decode_state(data: bytes) -> State:
    return _state_decoder.decode(data)
