"""Where an instance runs: a pure function of the model card, the request and State."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec

from exo.core.state import State
from exo.core.types import Instance, ModelCard, NodeInfo, RejectionCode, ShardAssignment, Sharding


class Unplaceable(msgspec.Struct, frozen=True):
    code: RejectionCode
    reason: str


def place_instance(
    card: ModelCard, sharding: Sharding, min_nodes: int, state: State, ids: Iterator[str]
) -> Instance | Unplaceable:
    if min_nodes < 1:
        return Unplaceable("invalid", "min_nodes must be at least 1")
    nodes = _nodes_by_free_memory(state)
    if not nodes:
        return Unplaceable("unavailable", "no worker node has joined the cluster yet")
    if min_nodes > len(nodes):
        return Unplaceable("conflict", f"min_nodes={min_nodes} but the cluster has {len(nodes)} node(s)")
    if min_nodes > 1:
        return Unplaceable("conflict", "placing one instance across several nodes is not supported yet")
    node = nodes[0]
    if card.storage_bytes and node.memory_available and card.storage_bytes > node.memory_available:
        return Unplaceable(
            "conflict",
            f"{card.model_id} needs {card.storage_bytes} bytes but the node with the most free memory "
            f"({node.node_id}) has {node.memory_available}",
        )
    shard = ShardAssignment(runner_id=next(ids), node_id=node.node_id, end_layer=card.n_layers)
    return Instance(instance_id=next(ids), model_id=card.model_id, sharding=sharding, shards=[shard])


def _nodes_by_free_memory(state: State) -> list[NodeInfo]:
    return sorted(state.nodes.values(), key=lambda n: (-n.memory_available, n.node_id))
