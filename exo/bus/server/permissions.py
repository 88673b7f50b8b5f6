"""Who may do what on exo's NATS: the users of the embedded server, and the permission block
docs/deploy.md gives for clusters you run yourself (a test keeps the two the same).

Two roles. `exo` is every exo process (API, master, worker, runner): each one provisions the
streams at start and a worker appends events by design, so a finer split would forbid nothing a
stolen worker credential could not already do; what keeps a forged event harmless is the
reducer, which checks it (see exo/core/apply.py). `operator` reads everything an operator's
`nats` commands and `exo inspect|replay|events` read, and changes nothing: no event, command,
token, snapshot or image can be written, no stream changed, and the master's consumer can be
neither taken over, deleted nor acknowledged for.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from exo.bus.subjects import (
    ALL_DOWNLOAD_CONTROLS,
    ALL_MODEL_SHARES,
    ALL_READERS,
    COMMANDS_STREAM,
    JETSTREAM_FLOW_CONTROL,
    MASTER_CONSUMER,
    group_names,
)
from exo.bus.subjects import jetstream_ack_subject as js_ack
from exo.bus.subjects import jetstream_api_subject as js_api

EXO_USER = "exo"
OPERATOR_USER = "operator"

ANY_STREAM = "*"  # a wildcard token: one stream, any name
ALL = ">"  # a wildcard token: every subject below

OPERATOR_PERMISSIONS: dict[str, dict[str, list[str]]] = {
    "publish": {
        "allow": [
            js_api("INFO"),
            js_api("STREAM.INFO", ALL), js_api("STREAM.LIST"), js_api("STREAM.NAMES"),
            js_api("STREAM.MSG.GET", ALL), js_api("DIRECT.GET", ALL),
            js_api("CONSUMER.INFO", ALL), js_api("CONSUMER.LIST", ALL), js_api("CONSUMER.NAMES", ALL),
            # Reading a stream in order takes a consumer of one's own (ordered, ephemeral),
            # with flow-control replies, and deleting it when done.
            js_api("CONSUMER.CREATE", ALL), js_api("CONSUMER.DELETE", ALL), js_api("CONSUMER.MSG.NEXT", ALL),
            JETSTREAM_FLOW_CONTROL,
            # ... and acknowledging what it delivers (`nats stream view`'s pager acks each message).
            # An ack moves only the consumer it names (every stream keeps messages by limits, so
            # none is removed by an ack), and exo's one acking consumer is denied below.
            js_ack(ALL),
        ],
        "deny": [
            js_api("CONSUMER.CREATE", COMMANDS_STREAM, MASTER_CONSUMER),
            js_api("CONSUMER.CREATE", COMMANDS_STREAM, MASTER_CONSUMER, ALL),
            # The legacy form names the consumer in the body, not the subject: {"name": "exo-master"}
            # there replaced the master's consumer (its filter, its ack wait). Readers of the
            # command stream use the named form (`nats` does).
            js_api("CONSUMER.CREATE", COMMANDS_STREAM),
            js_api("CONSUMER.DELETE", COMMANDS_STREAM, MASTER_CONSUMER),
            js_api("CONSUMER.MSG.NEXT", COMMANDS_STREAM, MASTER_CONSUMER),
            # An ack, nak or term of the master's delivery would settle a command it never decided.
            js_ack(COMMANDS_STREAM, MASTER_CONSUMER, ALL),
            # The same for every master group's master (its commands stream is EXO_COMMANDS_<group>,
            # its consumer named alike). The legacy form, with the stream's name alone, is denied per
            # group the server is started with (`authorization_block`).
            js_api("CONSUMER.CREATE", ANY_STREAM, MASTER_CONSUMER), js_api("CONSUMER.CREATE", ANY_STREAM, MASTER_CONSUMER, ALL),
            js_api("CONSUMER.DELETE", ANY_STREAM, MASTER_CONSUMER), js_api("CONSUMER.MSG.NEXT", ANY_STREAM, MASTER_CONSUMER),
            js_ack(ANY_STREAM, MASTER_CONSUMER, ALL),
        ],
    },
    "subscribe": {
        "allow": [ALL],
        # Subscribing to a request subject would let one answer it: model files, download
        # control, stream readers and the JetStream API are answered by nodes and the server only.
        "deny": [ALL_MODEL_SHARES, ALL_DOWNLOAD_CONTROLS, ALL_READERS, js_api(ALL)],
    },
}


def authorization_block(exo_password: str, operator_password: str, master_groups: Sequence[str] = ()) -> str:
    """The nats-server `authorization` block for both roles (JSON is valid nats-server config);
    `master_groups` (EXO_MASTER_GROUPS' names) adds each group's legacy consumer-create denial."""
    permissions = OPERATOR_PERMISSIONS
    if master_groups:
        legacy = [js_api("CONSUMER.CREATE", group_names(g).commands_stream) for g in master_groups]
        publish = OPERATOR_PERMISSIONS["publish"]
        permissions = {**OPERATOR_PERMISSIONS, "publish": {**publish, "deny": [*publish["deny"], *legacy]}}
    users = [
        {"user": EXO_USER, "password": exo_password},
        {"user": OPERATOR_USER, "password": operator_password, "permissions": permissions},
    ]
    return "authorization: " + json.dumps({"users": users}, indent=2) + "\n"
