"""Where an instance runs: a pure function of the model card, the request and State.

No I/O and no clocks: the same card, request and State always give the same placement, so
the master's decision replays exactly and `GET /instance/previews` shows what placing would do.
The rules (candidates, tensor and pipeline splits, context, memory, ring ports, the order of the
checks) are written out in docs/multinode.md, "Placement".
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec

from exo.core.ids import InstanceId, NodeId, RunnerId
from exo.core.kv_budget import (
    KV_BITS,
    MIN_AUTO_CONTEXT,
    context_cap,
    default_context,
    head_dim_of,
    kv_group_size,
    least_context,
    rank_kv_bytes,
    tokens_that_fit,
)
from exo.core.node_names import node_display
from exo.core.placement_nodes import (
    lacks_files,
    least_loaded_first,
    most_free_first,
    nodes_by_free_memory,
    offline_note,
    preference_tiers,
)
from exo.core.sizes import human_bytes as human_bytes  # re-exported: the API and tests import it from here
from exo.core.sizes import needed_and_free as needed_and_free
from exo.core.state import State
from exo.core.types import Instance, ModelCard, NodeInfo, RejectionCode, ShardAssignment, Sharding

SHARDINGS: tuple[Sharding, ...] = ("pipeline", "tensor")


class Unplaceable(msgspec.Struct, frozen=True):
    code: RejectionCode
    reason: str


class PlacementPreview(msgspec.Struct, frozen=True, kw_only=True):
    """What placing on exactly `node_count` nodes would give: an instance, or why not."""

    sharding: Sharding
    node_count: int
    instance: Instance | None = None
    rejection: Unplaceable | None = None


class _Rank(msgspec.Struct, frozen=True, kw_only=True):
    node_id: NodeId
    start_layer: int
    end_layer: int
    ring_address: str = ""
    memory_bytes: int = 0
    kv_bytes: int = 0


class _Plan(msgspec.Struct, frozen=True, kw_only=True):
    ranks: list[_Rank]
    max_context: int
    kv_bits: int = 0


# Node sets in the order placement tries them, each as (most free memory first, least loaded first).
_Tiers = list[tuple[list[NodeInfo], list[NodeInfo]]]


def place_instance(
    card: ModelCard, sharding: Sharding, min_nodes: int, state: State, ids: Iterator[str], max_context: int = 0,
    kv_bits: int = 0, force: bool = False, exclude: frozenset[str] = frozenset(),
) -> Instance | Unplaceable:
    """Place one instance on the fewest nodes (at least min_nodes) that can hold it, the least
    loaded of those that do, none of them in `exclude` (suspect nodes, or those its replicas use).

    Takes runner ids from `ids` first (one per rank, in rank order), then the instance id;
    takes nothing when the request cannot be placed.
    """
    if min_nodes < 1:
        return Unplaceable("invalid", "min_nodes must be at least 1")
    if (invalid := _invalid_request(card, max_context, kv_bits, force)) is not None:
        return invalid
    if min_nodes > 1 and (one_node := _one_node_only(card)) is not None:
        return one_node
    usable = [n for n in nodes_by_free_memory(state) if n.node_id not in exclude]
    if not usable:
        return Unplaceable("unavailable", "no worker node has joined the cluster yet" if not state.nodes
                           else f"no node is free for it ({len(state.nodes)} in the cluster, none usable now)")
    lacking = [n for n in usable if lacks_files(card, n, state)]
    note = offline_note(card, lacking, state)
    nodes = [n for n in usable if n not in lacking]
    if not nodes:
        return Unplaceable("unavailable", f"no node can get {card.model_id}: {note}")
    if min_nodes > len(nodes):
        count = f"{len(nodes)} usable node(s)" if len(nodes) < len(state.nodes) else f"{len(nodes)} node(s)"
        return _noted(Unplaceable("conflict", f"min_nodes={min_nodes} but the cluster has {count}"), note)
    tiers = _tiers(card, nodes, state)
    first_failure: Unplaceable | None = None
    for k in range(min_nodes, _most_nodes(card, nodes) + 1):
        planned = _plan_preferring(k, card, sharding, tiers, state, max_context, kv_bits, force)
        if not isinstance(planned, Unplaceable):
            return _instance(card, sharding, planned, ids)
        first_failure = first_failure or planned
    assert first_failure is not None
    most = _most_nodes(card, nodes)
    if most == min_nodes:
        return _noted(first_failure, note)
    tried = f"{most} nodes" if most == min_nodes + 1 else f"{min_nodes + 1} to {most} nodes"
    return _noted(Unplaceable(first_failure.code, f"{first_failure.reason}; {tried} did not work either"), note)


def _noted(refusal: Unplaceable, note: str) -> Unplaceable:
    return Unplaceable(refusal.code, f"{refusal.reason}; {note}") if note else refusal


def _tiers(card: ModelCard, nodes: list[NodeInfo], state: State) -> _Tiers:
    return [(tier, least_loaded_first(state, tier)) for tier in preference_tiers(card, nodes, state)]


def _plan_preferring(k: int, card: ModelCard, sharding: Sharding, tiers: _Tiers, state: State, max_context: int,
                     kv_bits: int, force: bool) -> _Plan | Unplaceable:
    """The plan on k nodes of the first node set that gives one (nodes that can get the model's
    files before offline ones that may not); else why the last, widest set cannot."""
    planned: _Plan | Unplaceable = Unplaceable("unavailable", "")
    for by_memory, preferred in tiers:
        if len(by_memory) >= k:
            planned = _plan_on(k, card, sharding, by_memory, preferred, state, max_context, kv_bits, force)
            if isinstance(planned, _Plan):
                return planned
    return planned


# mlx-vlm has no sharding: a vision-language model is served whole, by one runner; so is an
# embedding model (one forward pass per batch, nothing a ring would save).
_ONE_NODE_ONLY = Unplaceable("conflict", "a vision model runs on one node (mlx-vlm cannot split a model "
                                         "across nodes): min_nodes must be 1")
_EMBEDDING_ONE_NODE = Unplaceable("conflict", "an embedding model runs on one node: min_nodes must be 1")


_SPEECH_ONE_NODE = Unplaceable("conflict", "a speech-to-text model runs on one node (mlx-audio cannot split a "
                                           "model): min_nodes must be 1")


_TEXT_TO_SPEECH_ONE_NODE = Unplaceable("conflict", "a text-to-speech model runs on one node (mlx-audio cannot "
                                                   "split a model): min_nodes must be 1")


def _one_node_only(card: ModelCard) -> Unplaceable | None:
    if card.transcribes:
        return _SPEECH_ONE_NODE
    if card.speaks:
        return _TEXT_TO_SPEECH_ONE_NODE
    return _ONE_NODE_ONLY if card.supports_images else _EMBEDDING_ONE_NODE if card.embedding is not None else None


def _most_nodes(card: ModelCard, nodes: list[NodeInfo]) -> int:
    return 1 if _one_node_only(card) else len(nodes)


def _invalid_request(card: ModelCard, max_context: int, kv_bits: int, force: bool) -> Unplaceable | None:
    if card.storage_bytes <= 0 and not force:
        return Unplaceable("conflict", f"the size of {card.model_id} is unknown (its card has no storage_bytes), so "
                                       "exo cannot check that it fits in memory: add the card again by its Hub id or "
                                       "path so exo measures it, give storage_bytes, or place it anyway with "
                                       '"force": true')
    if max_context != 0 and not least_context(card) <= max_context <= context_cap(card):
        return Unplaceable("invalid", f"max_context must be 0 (the most that fits) or between {least_context(card)} and "
                                      f"{card.model_id}'s context length, {context_cap(card)}; got {max_context}")
    if kv_bits and (card.supports_images or card.embedding is not None):
        return Unplaceable("invalid", "a quantized KV cache (kv_bits) is not served for vision or embedding models")
    if kv_bits and card.transcribes:
        return Unplaceable("invalid", "a quantized KV cache (kv_bits) is not served for speech-to-text models")
    if kv_bits and card.speaks:
        return Unplaceable("invalid", "a quantized KV cache (kv_bits) is not served for text-to-speech models")
    if kv_bits and kv_bits not in KV_BITS:
        return Unplaceable("invalid", f"kv_bits must be 0 (not quantized) or one of {list(KV_BITS)}; got {kv_bits}")
    if kv_bits and not kv_group_size(head_dim_of(card)):
        return Unplaceable("invalid", f"{card.model_id}'s KV cache cannot be quantized: its head dim, "
                                      f"{head_dim_of(card)}, is not a multiple of 32")
    return None


def placement_previews(card: ModelCard, state: State, max_context: int = 0, kv_bits: int = 0,
                       force: bool = False) -> list[PlacementPreview]:
    """Every sharding on exactly 1..N nodes: the instance it would give (ids "preview-<n>"), or why not.

    Placing with that sharding and min_nodes equal to a valid preview's node count gives that
    placement (with real ids), since the fewest nodes that work win.
    """
    lacking = [n for n in state.nodes.values() if lacks_files(card, n, state)]
    note = offline_note(card, lacking, state)
    nodes = [n for n in nodes_by_free_memory(state) if n.node_id not in {m.node_id for m in lacking}]
    tiers = _tiers(card, nodes, state)
    previews = []
    if (invalid := _invalid_request(card, max_context, kv_bits, force)) is not None:
        return [PlacementPreview(sharding=sharding, node_count=1, rejection=invalid) for sharding in SHARDINGS]
    for sharding in SHARDINGS:
        if not nodes:
            previews.append(PlacementPreview(sharding=sharding, node_count=1, rejection=Unplaceable(
                "unavailable", f"no node can get {card.model_id}: {note}" if lacking
                else "no worker node has joined the cluster yet")))
            continue
        for k in range(1, len(nodes) + 1):
            planned = _plan_preferring(k, card, sharding, tiers, state, max_context, kv_bits, force) \
                if k <= _most_nodes(card, nodes) else (_one_node_only(card) or _ONE_NODE_ONLY)
            if isinstance(planned, Unplaceable):
                previews.append(PlacementPreview(sharding=sharding, node_count=k, rejection=_noted(planned, note)))
            else:
                ids = (f"preview-{n}" for n in range(k + 1))
                previews.append(PlacementPreview(sharding=sharding, node_count=k,
                                                 instance=_instance(card, sharding, planned, ids)))
    return previews


def split_layers(n_layers: int, weights: list[int]) -> list[int]:
    """Layers per rank in proportion to weights: each rank >= 1, sum n_layers (needs len(weights) <= n_layers).

    Largest-remainder rounding, ties to the lower rank. A rank whose share rounds to nothing is
    given one layer and the rest are shared out again among the others. All weights 0: equal.
    """
    k = len(weights)
    assert 1 <= k <= n_layers, (k, n_layers)
    layers = [0] * k
    fixed: set[int] = set()
    while True:
        free = [r for r in range(k) if r not in fixed]
        left = n_layers - len(fixed)
        w = {r: weights[r] for r in free}
        if sum(w.values()) <= 0:
            w = {r: 1 for r in free}
        total = sum(w.values())
        for r in free:
            layers[r] = left * w[r] // total
        extra = left - sum(layers[r] for r in free)
        for r in sorted(free, key=lambda r: (-(left * w[r] % total), r))[:extra]:
            layers[r] += 1
        empty = [r for r in free if layers[r] == 0]
        if not empty:
            return layers
        for r in empty:  # at least one free rank has layers, since left >= len(free)
            layers[r] = 1
            fixed.add(r)


def _plan_on(k: int, card: ModelCard, sharding: Sharding, by_memory: list[NodeInfo], preferred: list[NodeInfo],
             state: State, max_context: int, kv_bits: int, force: bool) -> _Plan | Unplaceable:
    """The plan on k nodes: the least loaded ones that hold it with the context wanted, else the
    first that holds it at all; else why the k with the most free memory (its best chance) cannot."""
    tries = [[n] for n in preferred] if k == 1 else [sorted(preferred[:k], key=most_free_first)]
    tries.append(by_memory[:k])
    want = max_context or default_context(card)
    planned: _Plan | Unplaceable = Unplaceable("unavailable", "")
    fallback: _Plan | None = None
    for nodes in tries:
        planned = _plan(card, sharding, nodes, state, max_context, kv_bits, force)
        if isinstance(planned, _Plan) and planned.max_context >= want:
            return planned
        fallback = fallback or (planned if isinstance(planned, _Plan) else None)
    return fallback or planned


def _plan(card: ModelCard, sharding: Sharding, nodes: list[NodeInfo], state: State, max_context: int,
          kv_bits: int = 0, force: bool = False) -> _Plan | Unplaceable:
    """The ranks on exactly these nodes (rank order = this order), or why they cannot hold the model."""
    k = len(nodes)
    split = _split(card, sharding, nodes)
    if isinstance(split, Unplaceable):
        return split
    blocks, needs = split
    if card.storage_bytes > 0 and not force:
        for rank, (node, need) in enumerate(zip(nodes, needs, strict=True)):
            if node.memory_available and need > node.memory_available:
                return Unplaceable("conflict", _memory_reason(state, card, sharding, nodes, rank, need, blocks[rank]))
    context = (max_context or default_context(card)) if force else \
        _context(state, card, sharding, nodes, blocks, needs, max_context, kv_bits)
    if isinstance(context, Unplaceable):
        return context
    kv = [rank_kv_bytes(card, sharding, k, block, context, kv_bits) for block in blocks]
    if k == 1:
        return _Plan(ranks=[_Rank(node_id=nodes[0].node_id, start_layer=blocks[0][0], end_layer=blocks[0][1],
                                  memory_bytes=needs[0], kv_bytes=kv[0])], max_context=context, kv_bits=kv_bits)
    for node in nodes:
        if not node.addresses:
            return Unplaceable("conflict", f"node {node_display(state, node.node_id)} reports no address peers can reach it on, "
                                           f"so it cannot take part in an instance across {k} nodes")
        if node.ring_port_count <= 0:
            return Unplaceable("conflict", f"node {node_display(state, node.node_id)} allows no ring ports, "
                                           f"so it cannot take part in an instance across {k} nodes")
    used = _used_ring_ports(state)
    ranks = []
    for node, (start, end), need, reserve in zip(nodes, blocks, needs, kv, strict=True):
        ip = node.addresses[0]
        ports = range(node.ring_port_first, node.ring_port_first + node.ring_port_count)
        # From a place that moves with the log: an instance placed right after one was deleted (a
        # replacement) does not take the port the deleted one's runner may still hold while it stops,
        # where a peer rank would connect to it.
        turn = state.last_seq % len(ports)
        port = next((p for p in [*ports[turn:], *ports[:turn]] if (ip, p) not in used), None)
        if port is None:
            return Unplaceable("conflict", f"no free ring port on node {node_display(state, node.node_id)}: ports {ports.start}-"
                                           f"{ports.stop - 1} on {ip} are all in use by other instances")
        used.add((ip, port))
        ranks.append(_Rank(node_id=node.node_id, start_layer=start, end_layer=end, ring_address=f"{ip}:{port}",
                           memory_bytes=need, kv_bytes=reserve))
    return _Plan(ranks=ranks, max_context=context, kv_bits=kv_bits)


def _split(card: ModelCard, sharding: Sharding, nodes: list[NodeInfo]) -> tuple[list[tuple[int, int]], list[int]] | Unplaceable:
    """Each rank's layers [start, end) and its share of the weights in bytes, or why the model
    cannot be split over these nodes this way."""
    k = len(nodes)
    if sharding == "tensor":
        if k > 1:
            known = [(count, what) for count, what in ((card.num_attention_heads, "attention heads"),
                                                        (card.num_key_value_heads, "key/value heads")) if count > 0]
            if any(count % k for count, _ in known):
                heads = " and ".join(f"{count} {what}" for count, what in known)
                return Unplaceable("conflict", f"tensor sharding over {k} nodes needs {k} to divide the head "
                                               f"counts, but {card.model_id} has {heads}")
        return [(0, card.n_layers)] * k, [-(-card.storage_bytes // k)] * k
    if k > 1 and card.n_layers <= 0:
        return Unplaceable("conflict", f"pipeline sharding over {k} nodes needs the layer count of "
                                       f"{card.model_id}, which its card does not give")
    if k > card.n_layers > 0:
        return Unplaceable("conflict", f"pipeline sharding over {k} nodes needs at least {k} layers, "
                                       f"but {card.model_id} has {card.n_layers}")
    if k == 1:
        return [(0, card.n_layers)], [card.storage_bytes]
    blocks, start = [], 0
    for count in split_layers(card.n_layers, [n.memory_available for n in nodes]):
        blocks.append((start, start + count))
        start += count
    return blocks, [-(-card.storage_bytes * (end - begin) // card.n_layers) for begin, end in blocks]


def _context(state: State, card: ModelCard, sharding: Sharding, nodes: list[NodeInfo], blocks: list[tuple[int, int]],
             needs: list[int], asked: int, kv_bits: int) -> int | Unplaceable:
    """The instance's max_context: `asked` if its KV cache fits beside the weights on every rank,
    else (not asked) the most that fits, up to the default."""
    want = asked or default_context(card)
    fits = [(tokens_that_fit(card, sharding, len(nodes), block, node.memory_available - need, kv_bits), rank)
            for rank, (node, block, need) in enumerate(zip(nodes, blocks, needs, strict=True)) if node.memory_available]
    most, rank = min(fits, default=(want, 0))
    if want <= most:
        return want
    if not asked and most >= MIN_AUTO_CONTEXT:
        return most
    node, block = nodes[rank], blocks[rank]
    name = node_display(state, node.node_id)
    where = f"on {name}" if len(nodes) == 1 else f"on rank {rank} ({name})"
    kv = rank_kv_bytes(card, sharding, len(nodes), block, want, kv_bits)
    return Unplaceable("conflict", f"{card.model_id} with a context of {want} tokens needs {human_bytes(kv)} of KV cache "
                                   f"{where} besides {human_bytes(needs[rank])} for the weights, but it has "
                                   f"{human_bytes(node.memory_available)} free: room for {max(most, 0)} tokens of context"
                                   + ("" if asked else f" (less than {MIN_AUTO_CONTEXT})")
                                   + "; ask for a smaller max_context, a quantized KV cache (kv_bits) or more nodes")


def _memory_reason(state: State, card: ModelCard, sharding: Sharding, nodes: list[NodeInfo], rank: int, need: int,
                   block: tuple[int, int]) -> str:
    node, k = nodes[rank], len(nodes)
    needed, free = needed_and_free(need, node.memory_available)
    if k == 1:
        return (f"{card.model_id} needs {needed}; the node with the most free memory "
                f"({node_display(state, node.node_id)}, {free} free) cannot hold it")
    share = f"{needed} on each node" if sharding == "tensor" else f"{needed} for layers {block[0]}-{block[1] - 1} on rank {rank}"
    return (f"{card.model_id} needs {human_bytes(card.storage_bytes)}; with {sharding} sharding over {k} nodes that "
            f"is {share}, but {node_display(state, node.node_id)} has {free} free (the {k} nodes with "
            f"the most free memory have {human_bytes(sum(n.memory_available for n in nodes))} in all, the most on "
            f"one node is {human_bytes(nodes[0].memory_available)})")


def _used_ring_ports(state: State) -> set[tuple[str, int]]:
    used = set()
    for instance in state.instances.values():
        for shard in instance.shards:
            ip, _, port = shard.ring_address.rpartition(":")
            if ip and port.isdigit():
                used.add((ip, int(port)))
    return used


def _instance(card: ModelCard, sharding: Sharding, plan: _Plan, ids: Iterator[str]) -> Instance:
    shards = [
        ShardAssignment(runner_id=RunnerId(next(ids)), node_id=r.node_id, rank=rank, world_size=len(plan.ranks),
                        start_layer=r.start_layer, end_layer=r.end_layer, ring_address=r.ring_address,
                        memory_bytes=r.memory_bytes, kv_bytes=r.kv_bytes)
        for rank, r in enumerate(plan.ranks)
    ]
    return Instance(instance_id=InstanceId(next(ids)), model_id=card.model_id, sharding=sharding, shards=shards,
                    max_context=plan.max_context, kv_bits=plan.kv_bits)
