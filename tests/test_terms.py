"""Terms that a publisher cannot forge: the latest leader.elected in the log leads, and its term is
its own stream sequence (exo/core/apply.py, exo/master/service.py). A forged election lasts only
until the lease holder elects itself again; a forged term written into an event raises nothing."""

from exo.core.apply import apply_all
from exo.core.events import InstanceCreated, InstanceDeleted, LeaderElected, TaskStarted
from exo.core.state import State
from tests.test_reducer import INSTANCE, fold


def test_the_latest_election_leads_with_its_own_sequence_as_term():
    state = fold([TaskStarted(task_id="x"), LeaderElected(node_id="a", lease_revision=40)], State())
    assert (state.leader_term, state.leader_node, state.leader_by_sequence) == (2, "a", True)
    state = fold([InstanceCreated(instance=INSTANCE, term=2)], state)
    assert "i1" in state.instances
    for term, why in [(1, "not the leader's term 2"), (3, "not the leader's term 2"), (10**12, "not the leader's term 2")]:
        state = fold([InstanceDeleted(instance_id="i1", term=term)], state)
        assert "i1" in state.instances and why in state.skipped_events[-1].reason


def test_a_forged_election_of_the_old_scheme_cannot_raise_the_term():
    state = fold([LeaderElected(node_id="a", lease_revision=5)], State())
    state = fold([LeaderElected(node_id="attacker", term=10**12)], state)
    assert (state.leader_term, state.leader_node) == (1, "a")
    assert "without a lease revision" in state.skipped_events[-1].reason
    state = fold([InstanceCreated(instance=INSTANCE, term=1)], state)  # the real master goes on
    assert "i1" in state.instances


def test_a_forged_election_of_the_new_scheme_lasts_until_the_holder_elects_itself_again():
    state = fold([LeaderElected(node_id="a", lease_revision=5)], State())
    state = fold([LeaderElected(node_id="attacker", lease_revision=10**12)], state)
    assert (state.leader_term, state.leader_node) == (2, "attacker")
    state = fold([InstanceCreated(instance=INSTANCE, term=1)], state)  # the displaced master's event: ignored
    assert state.instances == {}
    state = fold([LeaderElected(node_id="a", lease_revision=6), InstanceCreated(instance=INSTANCE, term=4)], state)
    assert (state.leader_term, state.leader_node) == (4, "a") and "i1" in state.instances


def test_logs_of_the_old_scheme_fold_as_before_and_then_switch():
    state = fold([LeaderElected(node_id="a", term=3), InstanceCreated(instance=INSTANCE, term=3),
                  LeaderElected(node_id="b", term=2)], State())  # lost the race, old rule
    assert (state.leader_term, state.leader_node, state.leader_by_sequence) == (3, "a", False)
    assert "i1" in state.instances
    state = fold([LeaderElected(node_id="b", lease_revision=9), InstanceDeleted(instance_id="i1", term=4)], state)
    assert (state.leader_term, state.leader_node) == (4, "b") and state.instances == {}


def test_a_masters_event_kind_without_a_term_is_skipped_whoever_wrote_it():
    """A stray or stolen-credential publisher's term-0 instance.deleted used to delete a live
    instance, and its card.added to shadow a card; every kind only a master writes needs the term."""
    from msgspec.structs import replace

    from exo.core.adapters import Adapter
    from exo.core.apply import MASTER_KINDS
    from exo.core.events import (
        AdapterAdded,
        AdapterDeleted,
        AdapterDeleting,
        CommandRejected,
        CustomCardAdded,
        CustomCardDeleted,
        DesireEnded,
        DesireScaled,
        DesireSet,
        GroupsSet,
        JoinTokenCreated,
        JoinTokenRedeemed,
        KeyDeleted,
        KeySet,
        NodeRegistered,
        NodeRemoved,
        NodeSuspected,
        NodeTimedOut,
        TaskCancelRequested,
        TaskCreated,
        TaskMigrated,
    )
    from exo.core.join_tokens import JoinToken
    from exo.core.keys import ApiKey
    from exo.core.types import Desire, ModelCard, NodeInfo, Task

    adapter = Adapter(name="real", base_model="org/real", digest="a" * 64, size=10, config="{}")
    key = ApiKey(key_id="key_" + "0" * 16, secret_sha256="b" * 64)
    state = fold([LeaderElected(node_id="a", lease_revision=5)], State())
    state = fold([NodeRegistered(node=NodeInfo(node_id="n1")), InstanceCreated(instance=INSTANCE, term=1),
                  TaskCreated(task=Task(task_id="t1", instance_id="i1", model_id="m/a"), term=1),
                  CustomCardAdded(card=ModelCard(model_id="org/real", n_layers=2), term=1),
                  AdapterAdded(adapter=adapter, term=1), KeySet(key=key, term=1)], state)
    assert state.adapters == {"real": adapter} and state.api_keys == {key.key_id: key}
    forged = [InstanceDeleted(instance_id="i1"), InstanceCreated(instance=INSTANCE.__copy__()),
              TaskCreated(task=Task(task_id="t2", instance_id="i1", model_id="m/a")),
              TaskCancelRequested(task_id="t1"), NodeTimedOut(node_id="n1"), NodeSuspected(node_id="n1", at=1.0),
              NodeRemoved(node_id="n1"),
              CustomCardAdded(card=ModelCard(model_id="org/builtin", path="/tmp/attacker", n_layers=2)),
              CustomCardDeleted(model_id="org/real"), CommandRejected(command_id="c1"),
              DesireSet(desire=Desire(desire_id="d1", model_id="m/a")), DesireEnded(desire_id="d0"),
              DesireScaled(desire_id="d0", from_replicas=1, to_replicas=2),
              TaskMigrated(task_id="t1"), AdapterAdded(adapter=replace(adapter, name="x")),
              AdapterDeleted(name="real"), AdapterDeleting(name="real"), KeySet(key=replace(key, admin=True)),
              KeyDeleted(key_id=key.key_id),
              GroupsSet(groups={"g": ["m/*"]}),
              JoinTokenCreated(token=JoinToken(token_id="0" * 16, secret_sha256="c" * 64, expires_at=9e9, uses_left=9,
                                               created_at=1.0)),
              JoinTokenRedeemed(token_id="0" * 16, secret_sha256="c" * 64)]
    assert {type(e) for e in forged} == MASTER_KINDS  # every master kind is tried
    after = apply_all(state, [(event, state.last_seq + n) for n, event in enumerate(forged, start=1)])  # as written
    assert (after.instances, after.tasks, after.nodes, after.custom_model_cards, after.desires, after.adapters,
            after.api_keys, after.groups, after.revoked_nodes, after.join_tokens) == (
        state.instances, state.tasks, state.nodes, state.custom_model_cards, state.desires, state.adapters,
        state.api_keys, state.groups, state.revoked_nodes, state.join_tokens)
    assert "c1" not in after.answered_commands
    assert [s.reason for s in after.skipped_events] == ["a master's event without a term"] * len(forged)


def test_a_runner_status_counts_only_for_the_node_and_instance_that_run_it():
    from exo.core.events import RunnerStatusChanged

    state = fold([LeaderElected(node_id="a", lease_revision=5), InstanceCreated(instance=INSTANCE, term=1)], State())
    for node, instance in [("n2", "i1"), ("n1", "i9")]:
        after = fold([RunnerStatusChanged(runner_id="r1", instance_id=instance, node_id=node, status="failed")], state)
        assert after.runners["r1"].status == "created" and "runs on node n1" in after.skipped_events[-1].reason
    after = fold([RunnerStatusChanged(runner_id="r1", instance_id="i1", node_id="n1", status="ready")], state)
    assert after.runners["r1"].status == "ready"
