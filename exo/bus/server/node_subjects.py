"""The subjects per-node permissions are made of (exo/core/node_roles.py's SubjectTable), in
today's scheme or in the proposed one where event, token and cache-report subjects and inboxes
name the node that writes or reads them (exo/core/node_roles.py says why).

Today's spellings come from exo/bus/subjects.py. The proposed ones are spelled here until the
publishers move to them; they then belong in exo/bus/subjects.py with the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

from nats.aio.client import DEFAULT_INBOX_PREFIX

from exo.bus.subjects import (
    ADAPTERS_BUCKET,
    ADAPTERS_STREAM,
    ALL_CACHE_REPORTS,
    ALL_COMMANDS,
    ALL_DOWNLOAD_CONTROLS,
    ALL_MODEL_SHARES,
    ALL_PULSES,
    ALL_READERS,
    COMMANDS_STREAM,
    IMAGES_BUCKET,
    IMAGES_STREAM,
    JETSTREAM_FLOW_CONTROL,
    LEADER_BUCKET,
    MASTER_CONSUMER,
    SHARED,
    STATE_BUCKET,
    download_control_subject,
    group_names,
    jetstream_ack_subject,
    jetstream_api_subject,
    model_share_subject,
    pulse_subject,
    token_subject,
)
from exo.core.ids import CommandId, NodeId

ANY = "*"
ALL = ">"
INBOX = DEFAULT_INBOX_PREFIX.decode()
ANY_GROUP = group_names(ANY)  # every master group's log: exo.group.*.events.> and its commands
ALL_TOKENS = token_subject(CommandId(ALL))


class NodeSubjects:
    """`writer_named`: the proposed scheme (a node's events on exo.events.<node>.<kind>, its chunks
    on exo.tokens.<command>.<node>, its cache reports on exo.cache.<node>.<instance>, its inbox
    under _INBOX.<node>, its disk-fit probe stream EXO_PROBE_<node>); else today's."""

    master_consumer = MASTER_CONSUMER

    def __init__(self, writer_named: bool = False) -> None:
        self.writer_named = writer_named

    def events(self, kind: str, writer: NodeId | None, groups: bool) -> list[str]:
        logs = [SHARED, ANY_GROUP] if groups else [SHARED]
        if self.writer_named:
            return [f"{names.all_events[:-len(ALL)]}{writer or ANY}.{kind}" for names in logs]
        return [names.event_subject(kind) for names in logs]

    def commands(self) -> list[str]:
        return [ALL_COMMANDS, ANY_GROUP.all_commands]

    def commands_streams(self, groups: Sequence[str]) -> list[str]:
        return [COMMANDS_STREAM, *(group_names(group).commands_stream for group in groups)]

    def pulse(self, node: NodeId | None) -> str:
        return pulse_subject(node) if node else ALL_PULSES

    def cache_reports(self, writer: NodeId | None) -> str:
        if writer is None:
            return ALL_CACHE_REPORTS
        return f"{ALL_CACHE_REPORTS[:-len(ALL)]}{writer}.{ANY}" if self.writer_named else f"{ALL_CACHE_REPORTS[:-len(ALL)]}{ANY}"

    def tokens(self, writer: NodeId | None) -> str:
        if writer is None:
            return ALL_TOKENS
        return token_subject(CommandId(f"{ANY}.{writer}" if self.writer_named else ANY))

    def model_shares(self, node: NodeId | None) -> str:
        return model_share_subject(node, ANY) if node else ALL_MODEL_SHARES

    def download_controls(self, node: NodeId | None) -> str:
        return download_control_subject(node, ANY) if node else ALL_DOWNLOAD_CONTROLS

    def readers(self) -> str:
        return ALL_READERS

    def inbox(self, node: NodeId) -> str:
        return f"{INBOX}.{node}.{ALL}" if self.writer_named else f"{INBOX}.{ALL}"

    def inbox_prefix(self, node: NodeId) -> str:
        """What the node's clients pass to nats-py as `inbox_prefix` for `inbox(node)` to hold their replies."""
        return f"{INBOX}.{node}" if self.writer_named else INBOX

    def snapshots(self) -> str:
        return f"$KV.{STATE_BUCKET}.{ALL}"  # every log's snapshot key (nats-py's KV spelling)

    def leases(self) -> str:
        return f"$KV.{LEADER_BUCKET}.{ALL}"

    def blobs(self) -> list[str]:
        return [f"$O.{IMAGES_BUCKET}.{ALL}", f"$O.{ADAPTERS_BUCKET}.{ALL}"]  # nats-py's object-store spelling

    def blob_streams(self) -> list[str]:
        return [IMAGES_STREAM, ADAPTERS_STREAM]

    def probe_stream(self, node: NodeId) -> str | None:
        return f"EXO_PROBE_{node}" if self.writer_named else None  # today's: EXO_PROBE_<random> (exo/bus/stream_fit.py)

    def jetstream_api(self, *tokens: str) -> str:
        return jetstream_api_subject(*tokens)

    def jetstream_ack(self, *tokens: str) -> str:
        return jetstream_ack_subject(*tokens)

    def flow_control(self) -> str:
        return JETSTREAM_FLOW_CONTROL
