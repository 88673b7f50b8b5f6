"""Placement on plain data: memory, divisibility, proportional layers, ring ports, reasons, previews."""

import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from exo.api.cluster import instances
from exo.api.context import CONTEXT_KEY, ApiContext
from exo.api.errors import STATUS_FOR_REJECTION, ApiError
from exo.core.placement import Unplaceable, place_instance, placement_previews, split_layers
from exo.core.state import State
from exo.core.types import Instance, ModelCard, NodeInfo, RunnerInfo, ShardAssignment

GB = 1_000_000_000
CARD = ModelCard(model_id="org/m", n_layers=8, num_attention_heads=16, num_key_value_heads=8, storage_bytes=8 * GB)


def node(node_id: str, memory: int, ip: str | None = None, first: int = 5000, count: int = 4) -> NodeInfo:
    ip = ip if ip is not None else f"10.0.0.{node_id[-1]}"
    return NodeInfo(node_id=node_id, memory_available=memory, addresses=[ip] if ip else [],
                    ring_port_first=first, ring_port_count=count)


def cluster_of(*nodes: NodeInfo, instances: tuple[Instance, ...] = ()) -> State:
    return State(nodes={n.node_id: n for n in nodes}, instances={i.instance_id: i for i in instances})


def ids():
    return (f"id{n}" for n in itertools.count())


def place(card=CARD, sharding="pipeline", min_nodes=1, state=None) -> Instance | Unplaceable:
    return place_instance(card, sharding, min_nodes, state, ids())


def layout(instance: Instance) -> list[tuple]:
    return [(s.node_id, s.rank, s.world_size, s.start_layer, s.end_layer, s.ring_address) for s in instance.shards]


# One node: as before.

def test_one_node_holds_every_layer_with_no_ring_address_and_takes_runner_ids_first():
    state = cluster_of(node("n1", 10 * GB), node("n2", 20 * GB))
    for sharding in ("pipeline", "tensor"):
        placed = place(sharding=sharding, state=state)
        assert isinstance(placed, Instance) and placed.sharding == sharding
        assert layout(placed) == [("n2", 0, 1, 0, 8, "")]
        assert placed.shards[0].runner_id == "id0" and placed.instance_id == "id1"


def test_a_node_without_addresses_or_memory_report_still_takes_a_one_node_instance():
    state = cluster_of(NodeInfo(node_id="n1"))  # memory 0: not reported, does not constrain
    assert layout(place(state=state)) == [("n1", 0, 1, 0, 8, "")]


# Memory.

def test_memory_limit_on_one_node():
    assert isinstance(place(state=cluster_of(node("n1", 8 * GB))), Instance)  # exactly fits: no margin
    assert place(state=cluster_of(node("n1", 8 * GB - 1))) == Unplaceable(
        "conflict", "org/m needs 8000000000 bytes; the node with the most free memory (n1, 7999999999 bytes free) "
                    "cannot hold it")  # so close that rounding would read "needs 8.0 GB, has 8.0 GB": exact bytes
    named = msgspec.structs.replace(node("n1", 23_100_000_000), name="studio-2", hostname="studio")
    big = ModelCard(model_id="org/big", n_layers=8, storage_bytes=229 * GB)
    assert place(card=big, state=cluster_of(named)) == Unplaceable(
        "conflict", "org/big needs 229 GB; the node with the most free memory (studio-2, 23.1 GB free) cannot hold it")


def test_pipeline_spills_onto_a_second_node_when_one_is_not_enough():
    state = cluster_of(node("n1", 6 * GB), node("n2", 2 * GB), node("n3", 1 * GB))
    placed = place(state=state)  # min_nodes=1, but no node holds 8 GB: the top two do, 6:2
    assert layout(placed) == [("n1", 0, 2, 0, 6, "10.0.0.1:5000"), ("n2", 1, 2, 6, 8, "10.0.0.2:5000")]
    assert [s.runner_id for s in placed.shards] == ["id0", "id1"] and placed.instance_id == "id2"


def test_tensor_needs_storage_over_k_on_every_node():
    state = cluster_of(node("n1", 5 * GB), node("n2", 4 * GB))
    assert layout(place(sharding="tensor", state=state)) == [
        ("n1", 0, 2, 0, 8, "10.0.0.1:5000"), ("n2", 1, 2, 0, 8, "10.0.0.2:5000")]
    state = cluster_of(node("n1", 5 * GB), node("n2", 4 * GB - 1))
    assert place(sharding="tensor", min_nodes=2, state=state) == Unplaceable(
        "conflict", "org/m needs 8.0 GB; with tensor sharding over 2 nodes that is 4000000000 bytes on "
                    "each node, but n2 has 3999999999 bytes free (the 2 nodes with the most free memory have 9.0 GB "
                    "in all, the most on one node is 5.0 GB)")


def test_pipeline_memory_rejection_names_the_rank_that_does_not_fit_and_the_larger_k_tried():
    state = cluster_of(node("n1", 4 * GB), node("n2", 2 * GB), node("n3", 1 * GB))
    assert place(state=state) == Unplaceable(
        "conflict", "org/m needs 8.0 GB; the node with the most free memory (n1, 4.0 GB free) cannot hold it; "
                    "2 to 3 nodes did not work either")
    assert place(min_nodes=2, state=state) == Unplaceable(
        "conflict", "org/m needs 8.0 GB; with pipeline sharding over 2 nodes that is 5.0 GB "
                    "for layers 0-4 on rank 0, but n1 has 4.0 GB free (the 2 nodes with the most free memory "
                    "have 6.0 GB in all, the most on one node is 4.0 GB); 3 nodes did not work either")
    assert place(min_nodes=3, state=state).reason.startswith(  # no "either": nothing larger to try
        "org/m needs 8.0 GB; with pipeline sharding over 3 nodes that is ")


def test_instances_not_loaded_yet_count_against_their_nodes_free_memory():
    """A node reports only what its runners have loaded: a second placement made before the first
    instance's runners load must not count the same free memory again."""
    small = ModelCard(model_id="org/s", n_layers=8, storage_bytes=6 * GB)
    state = cluster_of(node("n1", 10 * GB), node("n2", 7 * GB))
    first = place(card=small, state=state)
    assert layout(first) == [("n1", 0, 1, 0, 8, "")] and first.shards[0].memory_bytes == 6 * GB
    placed = cluster_of(node("n1", 10 * GB), node("n2", 7 * GB), instances=(first,))
    second = place_instance(small, "pipeline", 1, placed, iter(["r2", "i2"]))  # n1 has 4 GB left: n2 takes it
    assert layout(second) == [("n2", 0, 1, 0, 8, "")]
    both = cluster_of(node("n1", 10 * GB), node("n2", 7 * GB), instances=(first, second))
    assert place(card=small, state=both) == Unplaceable(
        "conflict", "org/s needs 6.0 GB; the node with the most free memory (n1, 4.0 GB free) cannot hold it; "
                    "2 nodes did not work either")
    for status, fits in [("loading", False), ("failed", False), ("warming_up", True), ("ready", True)]:
        # Loaded runners are in the node's own report (here: not yet, so the node has room again).
        runners = {s.runner_id: RunnerInfo(runner_id=s.runner_id, instance_id=i.instance_id, node_id=s.node_id,
                                           status=status) for i in (first, second) for s in i.shards}
        assert isinstance(place(card=small, state=msgspec.structs.replace(both, runners=runners)), Instance) == fits


# Divisibility and layers.

def test_tensor_needs_k_to_divide_heads_and_kv_heads():
    state = cluster_of(node("n1", 3 * GB), node("n2", 3 * GB), node("n3", 3 * GB), node("n4", 3 * GB))
    # 16 heads / 8 kv heads: 3 does not divide, 4 does -> 4 nodes (2 GB each)
    assert [s.node_id for s in place(sharding="tensor", min_nodes=3, state=state).shards] == ["n1", "n2", "n3", "n4"]
    odd = ModelCard(model_id="org/odd", storage_bytes=1, num_attention_heads=14, num_key_value_heads=2, n_layers=8)
    assert place(card=odd, sharding="tensor", min_nodes=4, state=state) == Unplaceable(
        "conflict", "tensor sharding over 4 nodes needs 4 to divide the head counts, but org/odd has "
                    "14 attention heads and 2 key/value heads")
    assert place(card=odd, sharding="tensor", min_nodes=3, state=state) == Unplaceable(
        "conflict", "tensor sharding over 3 nodes needs 3 to divide the head counts, but org/odd has "
                    "14 attention heads and 2 key/value heads; 4 nodes did not work either")
    assert len(place(card=odd, sharding="tensor", min_nodes=2, state=state).shards) == 2
    unknown_kv = ModelCard(model_id="org/u", storage_bytes=1, num_attention_heads=6, n_layers=8)
    assert place(card=unknown_kv, sharding="tensor", min_nodes=4, state=state).reason == (
        "tensor sharding over 4 nodes needs 4 to divide the head counts, but org/u has 6 attention heads")
    unknown = ModelCard(model_id="org/x", storage_bytes=1, n_layers=8)  # no head counts: nothing to check
    assert len(place(card=unknown, sharding="tensor", min_nodes=4, state=state).shards) == 4


def test_pipeline_needs_a_layer_per_rank_and_a_known_layer_count():
    state = cluster_of(node("n1", GB), node("n2", GB), node("n3", GB))
    two = ModelCard(model_id="org/two", storage_bytes=1, n_layers=2)
    assert place(card=two, min_nodes=3, state=state) == Unplaceable(
        "conflict", "pipeline sharding over 3 nodes needs at least 3 layers, but org/two has 2")
    assert len(place(card=two, min_nodes=2, state=state).shards) == 2
    nameless = ModelCard(model_id="org/n", storage_bytes=1)
    assert place(card=nameless, min_nodes=2, state=state) == Unplaceable(
        "conflict", "pipeline sharding over 2 nodes needs the layer count of org/n, which its card does not give; "
                    "3 nodes did not work either")
    assert layout(place(card=nameless, state=state)) == [("n1", 0, 1, 0, 0, "")]


# Proportional layers.

def test_layers_split_in_proportion_to_free_memory():
    assert split_layers(8, [3, 1]) == [6, 2]
    assert split_layers(8, [3 * GB, 1 * GB]) == [6, 2]
    assert split_layers(10, [1, 1, 1]) == [4, 3, 3]  # largest remainder, ties to the lower rank
    assert split_layers(7, [5, 3]) == [4, 3]  # 4.375 / 2.625: the larger remainder gets the spare layer
    assert split_layers(4, [1000, 1, 1]) == [2, 1, 1]  # every rank at least one layer
    assert split_layers(3, [0, 0, 0]) == [1, 1, 1]  # nothing known: equal
    assert split_layers(5, [7, 0]) == [4, 1]
    for n in range(3, 40):
        for weights in ([5, 3, 1], [1, 1, 1], [100, 1, 1], [2, 2, 1]):
            split = split_layers(n, weights)
            assert sum(split) == n and min(split) >= 1


def test_pipeline_blocks_are_contiguous_in_rank_order():
    state = cluster_of(node("n1", 3 * GB), node("n2", 9 * GB))
    placed = place(min_nodes=2, state=state)
    assert layout(placed) == [("n2", 0, 2, 0, 6, "10.0.0.2:5000"), ("n1", 1, 2, 6, 8, "10.0.0.1:5000")]


# Ring ports and addresses.

def test_ring_ports_avoid_ports_other_instances_use_on_the_same_ip():
    other = Instance(instance_id="old", model_id="org/m", shards=[
        ShardAssignment(runner_id="r0", node_id="n1", ring_address="10.0.0.1:5000"),
        ShardAssignment(runner_id="r1", node_id="n1", ring_address="10.0.0.1:5002"),
        ShardAssignment(runner_id="r2", node_id="elsewhere", ring_address="10.0.0.9:5001"),
    ])
    state = cluster_of(node("n1", 8 * GB), node("n2", 8 * GB), instances=(other,))
    placed = place(sharding="tensor", min_nodes=2, state=state)
    assert [s.ring_address for s in placed.shards] == ["10.0.0.1:5001", "10.0.0.2:5000"]


def test_two_nodes_on_one_ip_get_different_ports():
    state = cluster_of(node("n1", 8 * GB, ip="127.0.0.1"), node("n2", 8 * GB, ip="127.0.0.1"))
    placed = place(min_nodes=2, state=state)
    assert [s.ring_address for s in placed.shards] == ["127.0.0.1:5000", "127.0.0.1:5001"]


def test_no_free_ring_port():
    full = Instance(instance_id="old", model_id="org/m", shards=[
        ShardAssignment(runner_id=f"r{p}", node_id="n2", ring_address=f"10.0.0.2:{p}") for p in (5000, 5001)])
    state = cluster_of(node("n1", 8 * GB), node("n2", 8 * GB, count=2), instances=(full,))
    assert place(min_nodes=2, state=state) == Unplaceable(
        "conflict", "no free ring port on node n2: ports 5000-5001 on 10.0.0.2 are all in use by other instances")


def test_a_node_without_address_or_ring_ports_cannot_join_a_multi_node_instance():
    state = cluster_of(node("n1", 8 * GB), node("n2", 4 * GB, ip=""))
    assert place(min_nodes=2, state=state) == Unplaceable(
        "conflict", "node n2 reports no address peers can reach it on, so it cannot take part in an instance "
                    "across 2 nodes")
    state = cluster_of(node("n1", 8 * GB), node("n2", 4 * GB, count=0))
    assert place(min_nodes=2, state=state) == Unplaceable(
        "conflict", "node n2 allows no ring ports, so it cannot take part in an instance across 2 nodes")
    assert len(place(state=state).shards) == 1  # it still fits on n1 alone


# Fewer nodes first, other rejections, purity.

def test_prefers_fewer_nodes_and_honours_min_nodes():
    state = cluster_of(node("n1", 9 * GB), node("n2", 9 * GB), node("n3", 9 * GB))
    assert [s.node_id for s in place(state=state).shards] == ["n1"]
    assert [s.node_id for s in place(min_nodes=2, state=state).shards] == ["n1", "n2"]
    assert [s.node_id for s in place(min_nodes=3, state=state).shards] == ["n1", "n2", "n3"]


def test_other_rejections():
    state = cluster_of(node("n1", 9 * GB))
    assert place(min_nodes=0, state=state) == Unplaceable("invalid", "min_nodes must be at least 1")
    assert place(state=State()) == Unplaceable("unavailable", "no worker node has joined the cluster yet")
    assert place(min_nodes=2, state=state) == Unplaceable("conflict", "min_nodes=2 but the cluster has 1 node(s)")
    assert STATUS_FOR_REJECTION["conflict"] == 409  # the API answers a conflict with 409 and the reason


def test_a_rejection_takes_no_ids_and_placing_is_pure():
    state = cluster_of(node("n1", GB), node("n2", GB))
    fresh = ids()
    assert isinstance(place_instance(CARD, "pipeline", 1, state, fresh), Unplaceable)
    assert next(fresh) == "id0"
    roomy = cluster_of(node("n1", 6 * GB), node("n2", 3 * GB), node("n3", 2 * GB))
    assert place(state=roomy) == place(state=roomy)


# Previews.

def test_previews_list_each_sharding_on_each_node_count():
    state = cluster_of(node("n1", 6 * GB), node("n2", 4 * GB), node("n3", 2 * GB))
    previews = placement_previews(CARD, state)
    assert [(p.sharding, p.node_count) for p in previews] == [
        ("pipeline", 1), ("pipeline", 2), ("pipeline", 3), ("tensor", 1), ("tensor", 2), ("tensor", 3)]
    valid = {(p.sharding, p.node_count): p.instance for p in previews if p.instance is not None}
    invalid = {(p.sharding, p.node_count): p.rejection.reason for p in previews if p.rejection is not None}
    assert set(valid) == {("pipeline", 2), ("pipeline", 3), ("tensor", 2)}
    assert invalid == {
        ("pipeline", 1): "org/m needs 8.0 GB; the node with the most free memory (n1, 6.0 GB free) cannot hold it",
        ("tensor", 1): "org/m needs 8.0 GB; the node with the most free memory (n1, 6.0 GB free) cannot hold it",
        ("tensor", 3): "tensor sharding over 3 nodes needs 3 to divide the head counts, but org/m has "
                       "16 attention heads and 8 key/value heads",
    }
    # 6:4:2 of 8 layers is 4, 2.67, 1.33: the spare layer goes to the larger remainder (rank 1)
    assert layout(valid["pipeline", 3]) == [("n1", 0, 3, 0, 4, "10.0.0.1:5000"), ("n2", 1, 3, 4, 7, "10.0.0.2:5000"),
                                            ("n3", 2, 3, 7, 8, "10.0.0.3:5000")]
    for (sharding, k), instance in valid.items():  # what placing with min_nodes=k gives, but for the ids
        assert layout(place(sharding=sharding, min_nodes=k, state=state)) == layout(instance)
        assert [s.runner_id for s in instance.shards] + [instance.instance_id] == [f"preview-{n}" for n in range(k + 1)]


def test_previews_without_nodes_say_so():
    previews = placement_previews(CARD, State())
    assert [(p.sharding, p.node_count, p.rejection) for p in previews] == [
        ("pipeline", 1, Unplaceable("unavailable", "no worker node has joined the cluster yet")),
        ("tensor", 1, Unplaceable("unavailable", "no worker node has joined the cluster yet"))]


def _previews_request(state: State, model_id: str) -> web.Request:
    app = web.Application()
    app[CONTEXT_KEY] = ApiContext(nc=None, view=SimpleNamespace(state=state), outcomes=None,  # type: ignore[arg-type]
                                  builtin_cards={CARD.model_id: CARD}, node_id="", data_dir=Path("."))
    return make_mocked_request("GET", f"/instance/previews?model_id={model_id}", app=app)


async def test_previews_route_answers_every_placement_and_creates_nothing():
    state = cluster_of(node("n1", 6 * GB), node("n2", 4 * GB))
    response = await instances.instance_previews(_previews_request(state, "org/m"))
    previews = json.loads(response.body)["previews"]
    assert [(p["sharding"], p["min_nodes"], p["node_count"], p["error"] is None) for p in previews] == [
        ("pipeline", 1, 1, False), ("pipeline", 2, 2, True), ("tensor", 1, 1, False), ("tensor", 2, 2, True)]
    assert previews[0]["code"] == "conflict" and previews[0]["instance"] is None
    shards = previews[1]["instance"]["shards"]
    assert [(s["node_id"], s["start_layer"], s["end_layer"], s["ring_address"]) for s in shards] == [
        ("n1", 0, 5, "10.0.0.1:5000"), ("n2", 5, 8, "10.0.0.2:5000")]
    assert state.instances == {}
    with pytest.raises(ApiError) as unknown:
        await instances.instance_previews(_previews_request(state, "no/such"))
    assert unknown.value.status == 404


# Context: the KV cache of max_context tokens is reserved beside the weights.

# 8 layers x 8 KV heads x head dim 128 x 2 (K and V) x 2 bytes: 32 KiB a token, 1 GiB for 32768 tokens.
SIZED = ModelCard(model_id="org/kv", n_layers=8, hidden_size=2048, num_attention_heads=16, num_key_value_heads=8,
                  storage_bytes=4 * GB, context_length=131072)
PER_TOKEN = 8 * 8 * 128 * 2 * 2


def test_the_default_context_is_reserved_and_recorded_on_the_instance():
    placed = place(card=SIZED, state=cluster_of(node("n1", 10 * GB)))
    assert placed.max_context == 32768 and placed.shards[0].kv_bytes == 32768 * PER_TOKEN
    asked = place_instance(SIZED, "pipeline", 1, cluster_of(node("n1", 10 * GB)), ids(), max_context=100_000)
    assert asked.max_context == 100_000 and asked.shards[0].kv_bytes == 100_000 * PER_TOKEN


def test_without_room_for_the_default_the_most_that_fits_is_reserved():
    room = 5000 * PER_TOKEN  # beside the weights
    placed = place(card=SIZED, state=cluster_of(node("n1", 4 * GB + room)))
    assert placed.max_context == 4864  # 5000 rounded down to a multiple of 256


def test_a_context_that_does_not_fit_is_refused_with_the_numbers():
    state = cluster_of(node("n1", 4 * GB + 5000 * PER_TOKEN))
    refused = place_instance(SIZED, "pipeline", 1, state, ids(), max_context=8192)
    assert PER_TOKEN * 8192 == 268_435_456  # so that the sizes below read as they should
    assert refused == Unplaceable("conflict", "org/kv with a context of 8192 tokens needs 268 MB of KV cache on n1 "
                                              "besides 4.0 GB for the weights, but it has 4.2 GB free: room for 4864 "
                                              "tokens of context; ask for a smaller max_context, a quantized KV cache "
                                              "(kv_bits) or more nodes")
    tiny_room = place(card=SIZED, state=cluster_of(node("n1", 4 * GB + 1000 * PER_TOKEN)))
    assert isinstance(tiny_room, Unplaceable) and "room for 768 tokens of context (less than 2048)" in tiny_room.reason
    assert place_instance(SIZED, "pipeline", 1, state, ids(), max_context=131073).code == "invalid"
    assert place_instance(SIZED, "pipeline", 1, state, ids(), max_context=1).code == "invalid"  # serves nothing
    assert place_instance(SIZED, "pipeline", 1, state, ids(), max_context=-5).code == "invalid"


def test_tensor_ranks_share_the_heads_pipeline_ranks_their_layers():
    state = cluster_of(node("n1", 6 * GB), node("n2", 6 * GB))
    tensor = place_instance(SIZED, "tensor", 2, state, ids(), max_context=1024)
    assert [s.kv_bytes for s in tensor.shards] == [1024 * PER_TOKEN // 2] * 2
    pipeline = place_instance(SIZED, "pipeline", 2, state, ids(), max_context=1024)
    assert [s.kv_bytes for s in pipeline.shards] == [1024 * PER_TOKEN // 2] * 2  # 4 layers each


def test_every_instances_reservation_is_taken_off_its_node_loaded_or_not():
    first = place(card=SIZED, state=cluster_of(node("n1", 12 * GB)))
    loaded = State(nodes={"n1": node("n1", 12 * GB - 4 * GB)}, instances={first.instance_id: first},
                   runners={s.runner_id: RunnerInfo(runner_id=s.runner_id, instance_id=first.instance_id, node_id="n1",
                                                    status="ready") for s in first.shards})
    second = place(card=SIZED, state=loaded)  # 8 GB reported free, less the first's 1 GiB of KV, less 4 GB of weights
    assert second.max_context == 32768
    assert isinstance(place(card=msgspec.structs.replace(SIZED, storage_bytes=7 * GB), state=loaded), Unplaceable)


def test_cards_without_sizes_reserve_nothing():
    placed = place(card=ModelCard(model_id="org/m", n_layers=8, storage_bytes=GB), state=cluster_of(node("n1", GB)))
    assert placed.max_context == 32768 and placed.shards[0].kv_bytes == 0


def test_a_quantized_kv_cache_reserves_its_bits_and_group_scales():
    placed = place_instance(SIZED, "pipeline", 1, cluster_of(node("n1", 10 * GB)), ids(), kv_bits=8)
    per_token = 2 * 8 * 128 * (1 + 2 * 2 / 64) * 8  # a byte per element, a 2-byte scale and bias per 64
    assert placed.kv_bits == 8 and placed.shards[0].kv_bytes == 32768 * per_token
    room = 5000 * PER_TOKEN  # what held 4864 tokens unquantized holds more
    assert place_instance(SIZED, "pipeline", 1, cluster_of(node("n1", 4 * GB + room)), ids(), kv_bits=4).max_context == 17664
    assert place_instance(SIZED, "pipeline", 1, cluster_of(node("n1", 10 * GB)), ids(), kv_bits=7).code == "invalid"


# Vision models (mlx-vlm has no sharding): one node, whatever is asked.

VISION = msgspec.structs.replace(CARD, model_id="org/vl", supports_images=True)


def test_a_vision_model_is_placed_on_one_node_and_never_spills():
    state = cluster_of(node("n1", 10 * GB), node("n2", 20 * GB))
    for sharding in ("pipeline", "tensor"):
        assert layout(place(card=VISION, sharding=sharding, state=state)) == [("n2", 0, 1, 0, 8, "")]
    small = cluster_of(node("n1", 6 * GB), node("n2", 2 * GB))  # a text model would spill onto n2 here
    assert isinstance(place(state=small), Instance)
    assert place(card=VISION, state=small) == Unplaceable(
        "conflict", "org/vl needs 8.0 GB; the node with the most free memory (n1, 6.0 GB free) cannot hold it")


def test_a_vision_model_on_more_nodes_or_with_a_quantized_cache_is_refused_with_the_reason():
    state = cluster_of(node("n1", 10 * GB), node("n2", 20 * GB))
    refused = place(card=VISION, min_nodes=2, state=state)
    assert refused == Unplaceable("conflict", "a vision model runs on one node (mlx-vlm cannot split a model "
                                              "across nodes): min_nodes must be 1")
    assert STATUS_FOR_REJECTION[refused.code] == 409
    quantized = place_instance(VISION, "pipeline", 1, state, ids(), kv_bits=8)
    assert quantized == Unplaceable("invalid", "a quantized KV cache (kv_bits) is not served for vision or embedding models")


def test_previews_of_a_vision_model_say_that_it_runs_on_one_node():
    previews = placement_previews(VISION, cluster_of(node("n1", 10 * GB), node("n2", 20 * GB)))
    assert [(p.sharding, p.node_count, p.instance is not None) for p in previews] == [
        ("pipeline", 1, True), ("pipeline", 2, False), ("tensor", 1, True), ("tensor", 2, False)]
    assert {p.rejection.reason for p in previews if p.rejection} == {
        "a vision model runs on one node (mlx-vlm cannot split a model across nodes): min_nodes must be 1"}
