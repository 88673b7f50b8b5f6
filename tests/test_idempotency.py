"""Idempotency-Key's two guarantees that an HTTP test cannot time: a key finds its instance for as
long as the instance lives (State remembers only the latest answered commands), and two waiters
for one command each get the answer, whichever of them gives up first."""

from __future__ import annotations

import asyncio

import pytest

from exo.api.errors import ApiError
from exo.api.idempotency import earlier_placement
from exo.api.outcomes import CommandOutcomes
from exo.bus.state_view import StateView
from exo.core.events import InstanceCreated
from exo.core.ids import CommandId, InstanceId, ModelId
from exo.core.state import MAX_ANSWERED_COMMANDS, State
from exo.core.types import Instance
from tests.support.as_master import stamped, with_leader

KEYED = CommandId("idem-0123")


def test_a_key_finds_its_instance_after_state_forgot_the_command():
    instance = Instance(instance_id=InstanceId("i1"), model_id=ModelId("org/m"), command_id=KEYED)
    forgotten = State(instances={instance.instance_id: instance},
                      answered_commands={CommandId(f"chat-{n}"): n for n in range(MAX_ANSWERED_COMMANDS)})
    assert KEYED not in forgotten.answered_commands
    assert earlier_placement(forgotten, KEYED, ModelId("org/m")) == instance
    assert earlier_placement(State(), KEYED, ModelId("org/m")) is None  # a new key
    with pytest.raises(ApiError) as deleted:  # answered, but its instance is gone
        earlier_placement(State(answered_commands={KEYED: 7}), KEYED, ModelId("org/m"))
    assert deleted.value.status == 409


async def test_two_waiters_for_one_command_each_get_the_answer_when_one_gives_up(nc):
    view = StateView(nc, initial=with_leader())
    outcomes = CommandOutcomes(nc, view)
    first, second = outcomes.expect(KEYED), outcomes.expect(KEYED)
    first.cancel()  # the first request's client went away
    outcomes.forget(KEYED, first)
    answer = stamped(view.state, InstanceCreated(command_id=KEYED, instance=Instance(instance_id=InstanceId("i1"),
                                                                                     model_id=ModelId("m"))))
    await view._on_event(view.state.last_seq + 1, answer, lambda key: False)  # unsigned: with_leader names no key
    assert await asyncio.wait_for(second, 1) == answer
