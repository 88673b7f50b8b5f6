"""The embedded nats-server's configuration file, as text (pure: no I/O).

Standalone (no cluster) it is what exo always wrote: the two client users. In a cluster it adds
what a JetStream cluster needs and nothing an operator must edit:
- a system account user, for meta-group requests (step down, remove a peer) that only the
  system account may make;
- `server_tags`, so that exo's streams are placed on real nodes and never on a witness;
- a `cluster` block whose routes carry the cluster's secret (routes without it are refused).

A witness is a tiny JetStream server that only votes in the meta group: it lets one real node
have a quorum (a lone server in cluster mode has no JetStream at all).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import msgspec

from exo.bus.server.permissions import authorization_block

SYSTEM_ACCOUNT = "SYS"
SYSTEM_USER = "exo-system"
ROUTE_USER = "exo-route"
NODE_TAG = "exo-node"  # placement: exo's streams live on servers with this tag only
WITNESS_TAG = "exo-witness"
# A witness stores no stream (placement excludes it); small limits make sure of it.
WITNESS_LIMITS = {"max_memory_store": 1 << 20, "max_file_store": 1 << 20}


class ClusterLink(msgspec.Struct, frozen=True, kw_only=True):
    """How one embedded server takes part in a cluster."""

    name: str  # the cluster's name; unique per cluster, so that two never merge
    host: str  # where the cluster (route) port listens
    port: int
    secret: str  # the route password every member shares
    routes: list[str] = []  # nats-route://host:port of members to dial (credentials added here)
    witness: bool = False


def route_url(host: str, port: int) -> str:
    return f"nats-route://{host}:{port}"


def _with_route_credentials(route: str, secret: str) -> str:
    scheme, rest = route.split("://", 1)
    return f"{scheme}://{ROUTE_USER}:{secret}@{rest}"


def server_config(exo_password: str, operator_password: str, system_password: str,
                  max_payload: int, cluster: ClusterLink | None, master_groups: Sequence[str] = ()) -> str:
    """The whole config file. JSON values are valid nats-server config syntax."""
    lines = [f"max_payload: {max_payload}", authorization_block(exo_password, operator_password, master_groups)]
    if cluster is None:
        return "\n".join(lines)
    accounts = {SYSTEM_ACCOUNT: {"users": [{"user": SYSTEM_USER, "password": system_password}]}}
    block = {
        "name": cluster.name,
        "listen": f"{cluster.host}:{cluster.port or -1}",  # -1: any free port
        "authorization": {"user": ROUTE_USER, "password": cluster.secret},
        "routes": [_with_route_credentials(route, cluster.secret) for route in cluster.routes],
    }
    lines += [
        "accounts: " + json.dumps(accounts),
        f"system_account: {SYSTEM_ACCOUNT}",
        "server_tags: " + json.dumps([WITNESS_TAG if cluster.witness else NODE_TAG]),
        "cluster: " + json.dumps(block, indent=2),
    ]
    if cluster.witness:
        lines.append("jetstream: " + json.dumps(WITNESS_LIMITS))
    return "\n".join(lines) + "\n"
