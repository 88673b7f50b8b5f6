"""Prefill on one instance, decode on another, as the master, the reducer and a worker decide it
(exo/master/disaggregation.py, exo/worker/prefill_peers.py): which instance decodes, which one
prefills for it, the fallbacks, and what each worker tells its runner. The runners' exchange is
tests/test_prefill_peer.py; the whole path through a node is tests/test_prefill_split_e2e.py."""

import msgspec

from exo.core.apply import apply
from exo.core.commands import GenerateText, PlaceInstance
from exo.core.events import InstanceCreated, InstanceDeleted, NodeRegistered, RunnerStatusChanged, TaskCreated, TaskFinished
from exo.core.requests import ChatMessage, GenerationParams
from exo.core.state import State
from exo.core.types import Instance, Migration, NodeInfo, ShardAssignment, Task
from exo.runner.protocol import ExpectPrefill, PrefillPeer
from exo.worker.plan import ExpectPrefillTask, LocalRunner, WorkerView, nodes_concerned, plan
from exo.worker.prefill_peers import expectation_of, prefill_peer_of
from tests.support.as_master import stamped
from tests.test_decide import rejection, run, with_node

KEY_N1 = "UA" + "A" * 54  # the reducer keeps a node's key as given: the runners check signatures
HELLO = GenerationParams(messages=[ChatMessage(role="user", content="hello")])


def fold(state: State, *events) -> State:
    for event in events:
        state = apply(state, stamped(state, event), state.last_seq + 1)
    return state


def placed(state: State, command_id: str, role: str, **extra) -> tuple[State, Instance]:
    state, events = run(state, PlaceInstance(command_id=command_id, model_id="org/builtin", role=role, **extra))
    (instance,) = [e.instance for e in events if isinstance(e, InstanceCreated)]
    return state, instance


def ready(state: State, instance: Instance, address: str = "10.0.0.1:4100") -> State:
    shard = instance.shards[0]
    return fold(state, RunnerStatusChanged(runner_id=shard.runner_id, instance_id=instance.instance_id,
                                           node_id=shard.node_id, status="ready", prefill_address=address))


def split() -> tuple[State, Instance, Instance]:
    state = fold(with_node(), NodeRegistered(node=NodeInfo(node_id="n1", memory_available=10_000, public_key=KEY_N1)))
    state, prefill = placed(state, "p", "prefill")
    state, decode = placed(state, "d", "decode")
    return ready(ready(state, prefill), decode, address=""), prefill, decode


def ask(state: State, command_id: str = "g1", params: GenerationParams = HELLO) -> tuple[State, Task]:
    state, (created,) = run(state, GenerateText(command_id=command_id, model_id="org/builtin", params=params))
    assert isinstance(created, TaskCreated), created
    return state, created.task


def test_a_placed_role_is_the_desires_and_its_instances():
    state, prefill, decode = split()
    assert (prefill.role, decode.role) == ("prefill", "decode")
    assert state.desires["p"].role == "prefill" and state.desires["d"].role == "decode"
    assert state.runners[prefill.shards[0].runner_id].prefill_address == "10.0.0.1:4100"


def test_a_request_decodes_on_the_decode_instance_and_is_prefilled_on_the_prefill_instance():
    state, prefill, decode = split()
    _, task = ask(state)
    assert (task.instance_id, task.prefill_instance) == (decode.instance_id, prefill.instance_id)


def test_a_later_turn_whose_decode_instance_holds_the_conversation_prefills_there():
    """Its cache holds the earlier turns: it computes only the new ones, no transfer needed."""
    state, prefill, decode = split()
    system = ChatMessage(role="system", content="You are a coding agent. " * 20)
    first = GenerationParams(messages=[system, ChatMessage(role="user", content="Fix the bug in parse().")])
    state, task = ask(state, "turn1", first)
    assert task.prefill_instance == prefill.instance_id  # nothing of it cached anywhere yet
    state = fold(state, TaskFinished(task_id="turn1", status="completed"))
    later = GenerationParams(messages=[*first.messages, ChatMessage(role="assistant", content="Done."),
                                       ChatMessage(role="user", content="Now the tests.")])
    _, task = ask(state, "turn2", later)
    assert (task.instance_id, task.prefill_instance) == (decode.instance_id, "")
    _, task = ask(state, "other", GenerationParams(messages=[ChatMessage(role="user", content="unrelated")]))
    assert task.prefill_instance == prefill.instance_id


def test_without_a_ready_prefill_runner_or_node_keys_the_decode_instance_prefills_alone():
    state = fold(with_node(), NodeRegistered(node=NodeInfo(node_id="n1", memory_available=10_000, public_key=KEY_N1)))
    state, prefill = placed(state, "p", "prefill")
    state, decode = placed(state, "d", "decode")
    _, task = ask(state)  # the prefill runner is still loading: no address yet
    assert (task.instance_id, task.prefill_instance) == (decode.instance_id, "")
    _, task = ask(ready(state, prefill, address=""))  # ready, but serving nothing
    assert (task.instance_id, task.prefill_instance) == (decode.instance_id, "")
    assert ask(ready(state, prefill))[1].prefill_instance == prefill.instance_id
    # A node without a key (an older release) can neither sign an ask nor a cache.
    keyless = fold(ready(state, prefill), NodeRegistered(node=NodeInfo(node_id="n1", memory_available=10_000)))
    assert keyless.nodes["n1"].public_key == KEY_N1  # the first key stays (trust on first use)
    unkeyed = fold(with_node(), NodeRegistered(node=NodeInfo(node_id="n1", memory_available=10_000)))
    unkeyed, prefill = placed(unkeyed, "p", "prefill")
    unkeyed, decode = placed(unkeyed, "d", "decode")
    assert ask(ready(unkeyed, prefill))[1].prefill_instance == ""


def test_a_full_decode_side_leaves_the_prefill_instance_to_decode_alone():
    state = fold(with_node(), NodeRegistered(node=NodeInfo(node_id="n1", memory_available=10_000, public_key=KEY_N1)))
    state, prefill = placed(state, "p", "prefill")
    state, decode = placed(state, "d", "decode", max_queue=1)
    state = ready(state, prefill)
    state, first = ask(state, "g1")
    assert first.instance_id == decode.instance_id
    assert first.split_note == ""
    state, second = ask(state, "g2")
    assert (second.instance_id, second.prefill_instance) == (prefill.instance_id, "")
    assert second.split_note == f"decoded on prefill instance {prefill.instance_id}, alone: every decode instance is full"
    state = fold(state, InstanceDeleted(instance_id=decode.instance_id, reason="gone"))
    _, third = ask(state, "g3")
    assert third.split_note == f"decoded on prefill instance {prefill.instance_id}, alone: " \
                               "no decode instance of the model is serving"


def test_instances_without_roles_are_routed_as_before_and_never_paired():
    state = fold(with_node(), NodeRegistered(node=NodeInfo(node_id="n1", memory_available=10_000, public_key=KEY_N1)))
    state, prefill = placed(state, "p", "prefill")
    state, both = placed(state, "b", "both")
    _, task = ask(ready(state, prefill))
    assert (task.instance_id, task.prefill_instance) == (both.instance_id, "")


def test_images_and_another_kv_precision_are_prefilled_where_they_decode():
    state, _, decode = split()
    with_image = GenerationParams(messages=[ChatMessage(role="user", content="what is this", images=["ab" * 32])])
    _, task = ask(state, params=with_image)
    assert (task.instance_id, task.prefill_instance) == (decode.instance_id, "")
    state = fold(with_node(), NodeRegistered(node=NodeInfo(node_id="n1", memory_available=10_000, public_key=KEY_N1)))
    state, prefill = placed(state, "p", "prefill")
    state, decode = placed(state, "d", "decode", kv_bits=8)
    _, task = ask(ready(state, prefill))
    assert (task.instance_id, task.prefill_instance) == (decode.instance_id, "")


def test_a_role_is_for_an_instance_on_one_node():
    _, events = run(with_node(), PlaceInstance(command_id="c", model_id="org/builtin", min_nodes=2, role="decode"))
    assert rejection(events) == ("invalid", "a decode instance runs on one node: min_nodes must be 1")
    # A model no one node holds: placed across two nodes without a role, refused with one.
    small = [NodeInfo(node_id=n, memory_available=700, addresses=[f"10.0.0.{k}"], ring_port_first=5000,
                      ring_port_count=4) for k, n in enumerate(("n1", "n2"))]
    state = fold(with_node(), *(NodeRegistered(node=n) for n in small))
    assert len(placed(state, "both", "both")[1].shards) == 2
    code, reason = rejection(run(state, PlaceInstance(command_id="c", model_id="org/builtin", role="prefill"))[1])
    assert code == "conflict" and "a prefill instance runs on one node" in reason, reason


def test_the_reducer_keeps_only_a_ready_runners_well_formed_address():
    state, prefill, _ = split()
    for junk in ("evil host:1", "a:99999", "a:0", "a:", ":80", "x" * 130 + ":1", "a:1:b"):
        assert ready(state, prefill, address=junk).runners[prefill.shards[0].runner_id].prefill_address == "", junk
    for fine in ("192.168.1.5:4100", "[fe80::1]:4100", "mac-mini.local:65535"):
        assert ready(state, prefill, address=fine).runners[prefill.shards[0].runner_id].prefill_address == fine
    shard = prefill.shards[0]
    loading = fold(state, RunnerStatusChanged(runner_id=shard.runner_id, instance_id=prefill.instance_id,
                                              node_id=shard.node_id, status="loading", prefill_address="10.0.0.1:1"))
    assert loading.runners[shard.runner_id].prefill_address == ""


def test_the_prefill_worker_tells_its_runner_each_first_run_that_will_ask_once():
    state, prefill, decode = split()
    state, task = ask(state)
    runner = prefill.shards[0].runner_id
    local = LocalRunner(runner_id=runner, instance_id=prefill.instance_id, phase="ready")
    mine = WorkerView(node_id="n1", state=state, runners={runner: local})
    assert [s for s in plan(mine) if isinstance(s, ExpectPrefillTask)] == [
        ExpectPrefillTask(runner_id=runner, task_id=task.task_id)]
    told = msgspec.structs.replace(mine, runners={runner: msgspec.structs.replace(local, expected=frozenset({task.task_id}))})
    assert not [s for s in plan(told) if isinstance(s, ExpectPrefillTask)]
    loading = msgspec.structs.replace(mine, runners={runner: msgspec.structs.replace(local, phase="loading")})
    assert not [s for s in plan(loading) if isinstance(s, ExpectPrefillTask)]
    # Only the nodes a task's instances run on plan again for it: its prefill instance's among them.
    prefill_node = NodeInfo(node_id="n2", memory_available=10_000, public_key="UB" + "B" * 54)
    elsewhere = fold(state, NodeRegistered(node=prefill_node))
    moved = msgspec.structs.replace(prefill, shards=[msgspec.structs.replace(prefill.shards[0], node_id="n2")])
    elsewhere = fold(elsewhere, InstanceCreated(instance=msgspec.structs.replace(moved, instance_id="i-far")))
    created = TaskCreated(task=msgspec.structs.replace(task, task_id="t-far", prefill_instance="i-far"))
    assert nodes_concerned(elsewhere, created) == {"n1", "n2"}
    assert nodes_concerned(elsewhere, TaskCreated(task=msgspec.structs.replace(task, task_id="t-near"))) == {"n1"}
    assert expectation_of(state, task) == ExpectPrefill(task_id=task.task_id, asker="n1", asker_public_key=KEY_N1)
    assert prefill_peer_of(state, task) == PrefillPeer(address="10.0.0.1:4100", node_id="n1", public_key=KEY_N1)


def test_a_moved_task_resumes_from_its_tokens_and_asks_no_prefill():
    state, prefill, decode = split()
    state, task = ask(state)
    moved = msgspec.structs.replace(task, migrations=[Migration(from_instance=decode.instance_id,
                                                                to_instance=decode.instance_id)])
    assert prefill_peer_of(state, moved) is None and expectation_of(state, moved) is None
    keyless = Instance(instance_id="i9", model_id="org/builtin", shards=[ShardAssignment(runner_id="r9", node_id="n9")])
    assert prefill_peer_of(state, msgspec.structs.replace(task, prefill_instance=keyless.instance_id)) is None
