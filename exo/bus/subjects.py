"""The one table of subjects, stream and bucket names. Nothing else builds these strings."""

from typing import NamedTuple

from exo.core.ids import CommandId, InstanceId, NodeId

EVENTS_STREAM = "EXO_EVENTS"
COMMANDS_STREAM = "EXO_COMMANDS"
TOKENS_STREAM = "EXO_TOKENS"
STATE_BUCKET = "exo-state"
IMAGES_BUCKET = "exo-images"
ADAPTERS_BUCKET = "exo-adapters"  # LoRA adapters' weights, named by their sha256 hex
MASTER_CONSUMER = "exo-master"

ALL_EVENTS = "exo.events.>"
ALL_COMMANDS = "exo.commands.>"


def event_subject(tag: str) -> str:
    return f"exo.events.{tag}"


def command_subject(tag: str) -> str:
    return f"exo.commands.{tag}"


def token_subject(command_id: CommandId) -> str:
    return f"exo.tokens.{command_id}"

SNAPSHOT_KEY = "snapshot"
LEADER_KEY = "leader"
LEADER_BUCKET = "exo-leader"
IMAGES_STREAM = f"OBJ_{IMAGES_BUCKET}"
ADAPTERS_STREAM = f"OBJ_{ADAPTERS_BUCKET}"


# Core NATS request/reply between nodes (no stream keeps these): see exo/bus/peers/model_share.py and
# exo/bus/peers/download_control.py.
ALL_MODEL_SHARES = "exo.models.>"
ALL_DOWNLOAD_CONTROLS = "exo.downloads.>"


def model_share_subject(node_id: NodeId, what: str) -> str:
    """A node serving its models to peers: `what` is "manifest" or "chunk"."""
    return f"exo.models.{node_id}.{what}"


def download_control_subject(node_id: NodeId, action: str) -> str:
    """A node's download coordinator: `action` is "start", "cancel" or "delete"."""
    return f"exo.downloads.{node_id}.{action}"


# Core NATS, no stream: each node's pulse, every heartbeat interval (see exo/bus/liveness.py).
ALL_PULSES = "exo.liveness.>"


def pulse_subject(node_id: NodeId) -> str:
    return f"exo.liveness.{node_id}"


# Core NATS, no stream: "is anyone still reading this generation?", asked by an API node before
# it cancels a stream whose client left; answered by every API node with a reader of it
# (exo/bus/readers.py), so a stream resumed on another node is not cancelled under it.
ALL_READERS = "exo.readers.>"


def readers_subject(command_id: CommandId) -> str:
    return f"exo.readers.{command_id}"


# Core NATS, no stream: what an instance's rank 0 runner holds in its prompt cache, from its node's
# worker as it changes (and every few seconds), for every master's routing (exo/bus/cache_reports.py).
ALL_CACHE_REPORTS = "exo.cache.>"


def cache_report_subject(instance_id: InstanceId) -> str:
    return f"exo.cache.{instance_id}"


# JetStream's own subjects (nats-server names them; exo asks them and grants them in
# exo/bus/server/permissions.py). A token may be a wildcard: "*" for any stream, ">" for the rest.
JETSTREAM_FLOW_CONTROL = "$JS.FC.>"


def jetstream_api_subject(*tokens: str) -> str:
    """`$JS.API.<tokens>`: ("CONSUMER.CREATE", stream, consumer) creates that consumer."""
    return ".".join(("$JS.API", *tokens))


def jetstream_ack_subject(*tokens: str) -> str:
    """`$JS.ACK.<tokens>`: a delivery's reply subject, acked, nak'ed or termed by publishing to it."""
    return ".".join(("$JS.ACK", *tokens))


class LogNames(NamedTuple):
    """Where one master's log lives: the shared one (today's names) or a master group's
    (issue #34: a group owns the requests of its models). A group's subjects sit under
    `exo.group.<group>.`, not under `exo.events.>`/`exo.commands.>`: JetStream refuses two streams
    with overlapping subjects, and those belong to the shared streams."""

    group: str  # "" for the shared log
    events_stream: str
    all_events: str
    commands_stream: str
    all_commands: str
    leader_key: str
    snapshot_key: str

    def event_subject(self, tag: str) -> str:
        return f"{self.all_events[:-1]}{tag}"

    def command_subject(self, tag: str) -> str:
        return f"{self.all_commands[:-1]}{tag}"


SHARED = LogNames(group="", events_stream=EVENTS_STREAM, all_events=ALL_EVENTS, commands_stream=COMMANDS_STREAM,
                  all_commands=ALL_COMMANDS, leader_key=LEADER_KEY, snapshot_key=SNAPSHOT_KEY)


def snapshot_subject(names: LogNames) -> str:
    """Where a log's snapshot is stored (nats-py's KV layout); its signature covers this subject."""
    return f"$KV.{STATE_BUCKET}.{names.snapshot_key}"


def group_names(group: str) -> LogNames:
    """A master group's log (`group` is checked by exo/core/groups.py: letters, digits, _ and -)."""
    if not group:
        return SHARED
    return LogNames(group=group, events_stream=f"{EVENTS_STREAM}_{group}", all_events=f"exo.group.{group}.events.>",
                    commands_stream=f"{COMMANDS_STREAM}_{group}", all_commands=f"exo.group.{group}.commands.>",
                    leader_key=f"{LEADER_KEY}.{group}", snapshot_key=f"{SNAPSHOT_KEY}.{group}")
