"""What people call a node, the same in the log, State's reasons, the API and the dashboard
(exo/api/dashboard/static/names.js names them alike).

Pure: a node's name comes from its NodeInfo and, where two share it, from the others in State.
"""

from __future__ import annotations

from exo.core.ids import NodeId
from exo.core.state import State
from exo.core.types import NodeInfo

SHORT_ID = 8  # hex digits of a node id shown where its name is not enough


def node_label(node: NodeInfo) -> str:
    """A node as people know it: its name, else its hostname, else its id."""
    return node.name or node.hostname or node.node_id


def node_display(state: State, node_id: NodeId) -> str:
    """The node's name (else hostname), with its short id in parentheses where another node in
    State goes by the same one; its short id alone when State does not know it or it has neither."""
    node = state.nodes.get(node_id)
    base = _base_name(node) if node is not None else ""
    if not base:
        return node_id[:SHORT_ID]
    twins = sum(1 for other in state.nodes.values() if _base_name(other) == base)
    return f"{base} ({node_id[:SHORT_ID]})" if twins > 1 else base


def server_display(state: State, server_name: str) -> str:
    """A JetStream server of a discovered cluster (exo-<node id>, or exo-<node id>-witness: see
    exo/bus/server/cluster_node.py) named after its node; its own name when State has no such node."""
    node_id = NodeId(server_name.removeprefix("exo-").removesuffix("-witness"))
    if not server_name.startswith("exo-") or node_id not in state.nodes:
        return server_name
    label = node_display(state, node_id)
    return f"{label} witness" if server_name.endswith("-witness") else label


def _base_name(node: NodeInfo) -> str:
    return node.name or node.hostname
