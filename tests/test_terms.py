"""Terms that a publisher cannot forge: the latest leader.elected in the log leads, and its term is
its own stream sequence (exo/core/apply.py, exo/master/service.py). A forged election lasts only
until the lease holder elects itself again; a forged term written into an event raises nothing."""

from exo.core.events import InstanceCreated, InstanceDeleted, LeaderElected, TaskStarted
from tests.test_reducer import INSTANCE, fold


def test_the_latest_election_leads_with_its_own_sequence_as_term():
    state = fold([TaskStarted(task_id="x"), LeaderElected(node_id="a", lease_revision=40)])
    assert (state.leader_term, state.leader_node, state.leader_by_sequence) == (2, "a", True)
    state = fold([InstanceCreated(instance=INSTANCE, term=2)], state)
    assert "i1" in state.instances
    for term, why in [(1, "not the leader's term 2"), (3, "not the leader's term 2"), (10**12, "not the leader's term 2")]:
        state = fold([InstanceDeleted(instance_id="i1", term=term)], state)
        assert "i1" in state.instances and why in state.skipped_events[-1].reason


def test_a_forged_election_of_the_old_scheme_cannot_raise_the_term():
    state = fold([LeaderElected(node_id="a", lease_revision=5)])
    state = fold([LeaderElected(node_id="attacker", term=10**12)], state)
    assert (state.leader_term, state.leader_node) == (1, "a")
    assert "without a lease revision" in state.skipped_events[-1].reason
    state = fold([InstanceCreated(instance=INSTANCE, term=1)], state)  # the real master goes on
    assert "i1" in state.instances


def test_a_forged_election_of_the_new_scheme_lasts_until_the_holder_elects_itself_again():
    state = fold([LeaderElected(node_id="a", lease_revision=5)])
    state = fold([LeaderElected(node_id="attacker", lease_revision=10**12)], state)
    assert (state.leader_term, state.leader_node) == (2, "attacker")
    state = fold([InstanceCreated(instance=INSTANCE, term=1)], state)  # the displaced master's event: ignored
    assert state.instances == {}
    state = fold([LeaderElected(node_id="a", lease_revision=6), InstanceCreated(instance=INSTANCE, term=4)], state)
    assert (state.leader_term, state.leader_node) == (4, "a") and "i1" in state.instances


def test_logs_of_the_old_scheme_fold_as_before_and_then_switch():
    state = fold([LeaderElected(node_id="a", term=3), InstanceCreated(instance=INSTANCE, term=3),
                  LeaderElected(node_id="b", term=2)])  # lost the race, old rule
    assert (state.leader_term, state.leader_node, state.leader_by_sequence) == (3, "a", False)
    assert "i1" in state.instances
    state = fold([LeaderElected(node_id="b", lease_revision=9), InstanceDeleted(instance_id="i1", term=4)], state)
    assert (state.leader_term, state.leader_node) == (4, "b") and state.instances == {}
