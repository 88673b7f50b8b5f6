"""Placement spreads instances: with nodes that each have room, different models and a model's
replicas go to the least loaded nodes (fewest shards, then fewest open tasks), not all to one."""

import itertools
from pathlib import Path

import httpx
import msgspec
import pytest

from exo.core.commands import PlaceInstance
from exo.core.events import InstanceCreated
from exo.core.ids import CommandId, ModelId, TaskId
from exo.core.placement import Unplaceable, place_instance
from exo.core.state import State
from exo.core.types import Instance, ModelCard, NodeInfo, RunnerInfo, Task
from exo.master.decide import decide
from tests.support.cluster import NatsServer, node_process, state_of, wait_until
from tests.support.exo_process import interrupt_all, start_all
from tests.support.tiny_model import make_tiny_model

GB = 1_000_000_000


def card(name: str, size: int = 2 * GB) -> ModelCard:
    return ModelCard(model_id=ModelId(f"org/{name}"), n_layers=8, num_attention_heads=16, num_key_value_heads=8,
                     storage_bytes=size)


def node(node_id: str, memory: int = 10 * GB) -> NodeInfo:
    return NodeInfo(node_id=node_id, memory_available=memory, addresses=[f"10.0.0.{node_id[-1]}"],
                    ring_port_first=5000, ring_port_count=4)


def cluster_of(*nodes: NodeInfo) -> State:
    return State(nodes={n.node_id: n for n in nodes})


def loaded(state: State, instance: Instance, one_machine: bool = True) -> State:
    """State once the instance's runners are ready: its memory is in the nodes' own reports, on
    every node when they share one machine (the case that piled everything on one node)."""
    taken = sum(s.memory_bytes for s in instance.shards)
    runners = {s.runner_id: RunnerInfo(runner_id=s.runner_id, instance_id=instance.instance_id, node_id=s.node_id,
                                       status="ready") for s in instance.shards}
    nodes = {n.node_id: msgspec.structs.replace(n, memory_available=n.memory_available - taken)
             if one_machine or n.node_id in nodes_of(instance) else n for n in state.nodes.values()}
    return msgspec.structs.replace(state, nodes=nodes, instances={**state.instances, instance.instance_id: instance},
                                   runners={**state.runners, **runners})


def place(model: ModelCard, state: State, prefix: str, min_nodes: int = 1) -> Instance:
    placed = place_instance(model, "pipeline", min_nodes, state, (f"{prefix}{n}" for n in itertools.count()))
    assert isinstance(placed, Instance), placed
    return placed


def nodes_of(instance: Instance) -> list[str]:
    return [s.node_id for s in instance.shards]


def test_three_models_on_three_equal_nodes_of_one_machine_go_one_to_each():
    state = cluster_of(node("n1"), node("n2"), node("n3"))
    placed_on = []
    for name in ("a", "b", "c"):
        instance = place(card(name), state, name)
        placed_on += nodes_of(instance)
        state = loaded(state, instance)
    assert placed_on == ["n1", "n2", "n3"]


def test_replicas_go_to_the_nodes_without_instances():
    state = cluster_of(node("n1"), node("n2"), node("n3"))
    state = loaded(state, place(card("other"), state, "o"))  # on n1
    builtin = {ModelId("org/a"): card("a")}
    command = PlaceInstance(command_id=CommandId("c1"), model_id=ModelId("org/a"), replicas=2)
    events = decide(state, command, builtin_cards=builtin, ids=(f"id{n}" for n in itertools.count()))
    placed = [e.instance for e in events if isinstance(e, InstanceCreated)]
    assert [nodes_of(i) for i in placed] == [["n2"], ["n3"]]
    command = PlaceInstance(command_id=CommandId("c2"), model_id=ModelId("org/a"), replicas=3)
    events = decide(cluster_of(node("n1"), node("n2"), node("n3")), command, builtin_cards=builtin,
                    ids=(f"id{n}" for n in itertools.count()))
    assert [nodes_of(e.instance) for e in events if isinstance(e, InstanceCreated)] == [["n1"], ["n2"], ["n3"]]


def test_a_node_whose_instance_has_open_tasks_is_chosen_last():
    state = cluster_of(node("n1"), node("n2"), node("n3"))
    busy = place(card("busy"), state, "b")
    state = loaded(state, busy)
    idle = place(card("idle"), state, "i")
    state = loaded(state, idle)
    assert (nodes_of(busy), nodes_of(idle)) == (["n1"], ["n2"])
    task = Task(task_id=TaskId("t1"), instance_id=busy.instance_id, model_id=busy.model_id, status="running")
    state = msgspec.structs.replace(state, tasks={task.task_id: task})
    third = place(card("third"), state, "x")
    assert nodes_of(third) == ["n3"]  # holds nothing
    state = loaded(state, third)
    assert nodes_of(place(card("fourth"), state, "y")) == ["n2"]  # one idle instance, as n3: n2 by id; n1 last
    # With its task finished, n1 is as loaded as n2 and n3 and wins on its id.
    done = msgspec.structs.replace(state, tasks={task.task_id: msgspec.structs.replace(task, status="complete")})
    assert nodes_of(place(card("fourth"), done, "z")) == ["n1"]


def test_a_least_loaded_node_without_room_is_skipped():
    state = cluster_of(node("n1", 20 * GB), node("n2", 1 * GB), node("n3", 10 * GB))
    busy = place(card("busy"), state, "b")
    state = loaded(state, busy, one_machine=False)
    state = loaded(state, place(card("idle"), state, "i"), one_machine=False)
    task = Task(task_id=TaskId("t1"), instance_id=busy.instance_id, model_id=busy.model_id, status="running")
    state = msgspec.structs.replace(state, tasks={task.task_id: task})
    assert sorted(n for i in state.instances.values() for n in nodes_of(i)) == ["n1", "n3"]
    # n2 holds nothing but has 1 GB free; n1 has the most free memory but a busy instance: n3.
    assert nodes_of(place(card("next"), state, "x")) == ["n3"]
    # Room only on n1 (18 GB free): taken rather than spilling over two nodes.
    assert nodes_of(place(card("big", 15 * GB), state, "y")) == ["n1"]
    # Room nowhere: the refusal still names the node with the most free memory.
    refused = place_instance(card("huge", 19 * GB), "tensor", 1, state, iter(["r", "i"]))
    assert isinstance(refused, Unplaceable) and refused.reason.startswith(
        "org/huge needs 19.0 GB; the node with the most free memory (n1, 18.0 GB free) cannot hold it"), refused


def test_a_node_that_would_shrink_the_context_gives_way_to_one_that_keeps_it():
    # 32 KiB of KV cache a token: the default 32768 tokens take 1 GiB beside the 4 GB of weights.
    kv = ModelCard(model_id=ModelId("org/kv"), n_layers=8, hidden_size=2048, num_attention_heads=16,
                   num_key_value_heads=8, storage_bytes=4 * GB, context_length=131072)
    state = cluster_of(node("n1", 20 * GB), node("n2", 4 * GB + 5000 * 32768))
    state = loaded(state, place(card("a"), state, "a"), one_machine=False)  # on n1
    placed = place(kv, state, "k")
    assert (nodes_of(placed), placed.max_context) == (["n1"], 32768)  # n2 is idle but has room for 4864 tokens
    alone = msgspec.structs.replace(state, nodes={"n2": state.nodes["n2"]})
    assert place(kv, alone, "k").max_context == 4864  # where it is the only node, the context shrinks


def test_a_multi_node_instance_takes_the_least_loaded_nodes_with_ranks_by_free_memory():
    state = cluster_of(node("n1", 20 * GB), node("n2", 10 * GB), node("n3", 12 * GB))
    state = loaded(state, place(card("a"), state, "a"), one_machine=False)  # n1: the most free memory
    assert nodes_of(place(card("b", 8 * GB), state, "b", min_nodes=2)) == ["n3", "n2"]  # rank 0: more free memory
    # Too big for the two least loaded: the two with the most free memory hold it (still 2 nodes, not 3).
    assert nodes_of(place(card("c", 26 * GB), state, "c", min_nodes=2)) == ["n1", "n3"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.mark.slow
def test_three_models_on_three_worker_nodes_of_one_machine_go_one_to_each(tmp_path, model_dir):
    """Nodes on one machine report the same free memory: the case that piled everything on one."""
    nats = NatsServer(tmp_path / "nats")
    head, *workers = start_all([node_process(tmp_path, "head", nats.url, "--no-worker"),
                                *(node_process(tmp_path, f"worker{n}", nats.url, "--no-master", "--no-api") for n in (1, 2, 3))])
    try:
        wait_until(lambda: len(state_of(head).nodes) == 3, 60, what="three workers registered")
        with httpx.Client(base_url=head.url, timeout=180) as http:
            for name in ("one", "two", "three"):
                added = http.post("/models/add", json={"model_id": f"local/{name}", "path": str(model_dir)})
                assert added.status_code == 200, added.text
                placed = http.post("/place_instance", json={"model_id": f"local/{name}", "wait": 150})
                assert placed.status_code == 200, placed.text
        state = state_of(head)
        by_model = {i.model_id: [s.node_id for s in i.shards] for i in state.instances.values()}
        assert sorted(n for shards in by_model.values() for n in shards) == sorted(state.nodes), by_model
    finally:
        interrupt_all([*workers, head])
        nats.stop()
