"""Which nodes placement may use for a model, and in which order: by free memory (less what their
instances not yet loaded will take), least loaded first, and first those that can get its files.

An offline node (`exo --offline`) fetches nothing, neither from the Hub nor from a peer
(exo/worker/model_fetch.py refuses before asking either), so it can serve a model only from its
own disks. State knows what a node has only once it reported it (a completed download, "local"
when found on disk); what an offline node has not reported may still be on its disks. Pure, like
exo/core/placement.py.
"""

from __future__ import annotations

import msgspec

from exo.core.node_names import node_display
from exo.core.state import State
from exo.core.types import ModelCard, NodeInfo

LOADED = ("warming_up", "ready")  # a runner past loading: its node's own report counts its memory


def nodes_by_free_memory(state: State) -> list[NodeInfo]:
    """Live nodes, most free memory first, less what their instances not yet loaded will take."""
    coming = _memory_still_to_load(state)
    nodes = [_less_free(node, coming.get(node.node_id, 0)) for node in state.nodes.values()]
    return sorted(nodes, key=most_free_first)


def most_free_first(node: NodeInfo) -> tuple[int, str]:
    return -node.memory_available, node.node_id


def least_loaded_first(state: State, nodes: list[NodeInfo]) -> list[NodeInfo]:
    """Which nodes an instance goes to: fewest shards placed there, then fewest open tasks on them,
    then most free memory. Memory alone piles every instance on one node: nodes on one machine
    report the same free memory, and a loaded instance is already in its node's own report, so
    the tie went to the lowest node id each time. Rank order stays most free memory first."""
    shards: dict[str, int] = {}
    tasks: dict[str, int] = {}
    open_tasks = state.open_tasks_by_instance()
    for instance in state.instances.values():
        for shard in instance.shards:
            shards[shard.node_id] = shards.get(shard.node_id, 0) + 1
            tasks[shard.node_id] = tasks.get(shard.node_id, 0) + len(open_tasks.get(instance.instance_id, []))
    return sorted(nodes, key=lambda n: (shards.get(n.node_id, 0), tasks.get(n.node_id, 0), *most_free_first(n)))


def can_get_files(card: ModelCard, node: NodeInfo, state: State) -> bool:
    """The node may fetch the model, or reported a complete copy (a card's own path needs no fetch)."""
    if card.path or not node.offline:
        return True
    copy = state.download_of(node.node_id, card.model_id)
    return copy is not None and copy.status == "completed"


def lacks_files(card: ModelCard, node: NodeInfo, state: State) -> bool:
    """An offline node whose last try at the model failed: it found no complete copy on its disks.
    (Copied there since, it is found when the node is asked to download the model.)"""
    copy = state.download_of(node.node_id, card.model_id)
    return not can_get_files(card, node, state) and copy is not None and copy.status == "failed"


def preference_tiers(card: ModelCard, nodes: list[NodeInfo], state: State) -> list[list[NodeInfo]]:
    """The node sets placement tries in turn, each in the order of `nodes`: those that can get the
    model's files, then all of `nodes` (offline nodes that may hold a copy they have not reported)."""
    fetching = [n for n in nodes if can_get_files(card, n, state)]
    return [fetching, nodes] if fetching and len(fetching) < len(nodes) else [nodes]


def offline_note(card: ModelCard, lacking: list[NodeInfo], state: State) -> str:
    """Why `lacking` (offline nodes known to lack the model) were left out, for a refusal."""
    if not lacking:
        return ""
    names = ", ".join(node_display(state, n.node_id) for n in lacking)
    runs = "runs" if len(lacking) == 1 else "run"
    return (f"{names} {runs} offline (--offline) without {card.model_id} on disk, and an offline node fetches no "
            "model, from the Hub or from peers; copy it into a model directory there and ask that node to download "
            "it (POST /download/start finds the copy), or start a node without --offline")


def _memory_still_to_load(state: State) -> dict[str, int]:
    """Per node: the weights of shards not loaded yet, and every shard's KV reservation."""
    coming: dict[str, int] = {}
    for instance in state.instances.values():
        for shard in instance.shards:
            runner = state.runners.get(shard.runner_id)
            weights = shard.memory_bytes if runner is None or runner.status not in LOADED else 0
            coming[shard.node_id] = coming.get(shard.node_id, 0) + weights + shard.kv_bytes
    return coming


def _less_free(node: NodeInfo, taken: int) -> NodeInfo:
    if not taken or not node.memory_available:  # 0 means "not reported": it stays unconstrained
        return node
    return msgspec.structs.replace(node, memory_available=max(1, node.memory_available - taken))
