"""Folding events in tests as a cluster would: a master's kinds carry the leading term.

The reducer skips a master's event (instance, task, card, rejection, node time-out) without the
leading term (exo/core/apply.py). The master stamps it when it appends; tests that fold a
decider's events, or hand-made ones, stamp them here.
"""

from __future__ import annotations

from collections.abc import Iterable

from msgspec.structs import replace

from exo.core.apply import MASTER_KINDS, apply
from exo.core.events import AnyEvent
from exo.core.state import State

TEST_TERM = 1


def with_leader(state: State | None = None) -> State:
    """`state` (or an empty State) with a leader elected by sequence, if it has none yet."""
    state = state or State()
    if state.leader_term:
        return state
    return replace(state, leader_term=TEST_TERM, leader_node="test-master", leader_by_sequence=True)


def stamped(state: State, event: AnyEvent) -> AnyEvent:
    """The event as the leading master appends it: its term set, if it is a master's kind without one."""
    if type(event) in MASTER_KINDS and not event.term:
        return replace(event, term=state.leader_term)
    return event


def fold(events: Iterable[AnyEvent], state: State | None = None) -> State:
    """Each event applied at the next sequence, a master's stamped with the leading term; from
    `state`, or else from an empty State with a leader."""
    state = with_leader() if state is None else state
    for event in events:
        state = apply(state, stamped(state, event), state.last_seq + 1)
    return state
