"""Term fencing, live: a master that was deposed while it held a command appends that
command's events after the new election, through the real append path (the lease check that
passed before its pause is all it has). Those events are in the log, every node's reducer
skips them, the API's answer comes from the new master's decision, and the command is applied
exactly once, by the new master.

The lease check and the append are not atomic (a GC pause, a SIGSTOP, a slow disk between
them), so a stale master's append can always land after the election: only the fence keeps it
out of State. tests/test_failover.py's SIGSTOP test cannot show this, because there the lease
check stops the stale master before it appends."""

from __future__ import annotations

import asyncio
import collections

from exo.api.outcomes import CommandOutcomes
from exo.bus.connection import connect
from exo.bus.provision import provision
from exo.bus.state_view import StateView
from exo.bus.subjects import LEADER_BUCKET, LEADER_KEY
from exo.core.commands import AddCustomCard
from exo.core.events import CustomCardAdded, LeaderElected
from exo.core.types import ModelCard
from exo.master.service import Master
from tests.conftest import eventually
from tests.support.cluster import replay

HELD = "fence/held"


class PausedMaster(Master):
    """Holds one command between fetching it and appending its events, until released."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.holding = asyncio.Event()
        self.release = asyncio.Event()

    async def handle(self, command) -> None:
        if command.card.model_id == HELD and not self.release.is_set():
            self.holding.set()
            await self.release.wait()
            self._lease.valid = lambda: True  # checked before the pause, as far as this master knows
        await super().handle(command)


async def test_a_deposed_master_appends_after_the_election_and_every_reducer_skips_it(fresh_nats):
    clients = [await connect([fresh_nats], name=f"fence-{n}") for n in range(3)]
    await provision(clients[0])
    views = [StateView(nc) for nc in clients]
    for view in views:
        await view.start()
    stale = PausedMaster(clients[0], views[0], {}, node_id="stale")
    new = Master(clients[1], views[1], {}, node_id="new")
    running = [asyncio.create_task(stale.run())]
    try:
        await eventually(lambda: views[2].state.leader_node == "stale", 20)
        stale_term = views[2].state.leader_term
        outcomes = CommandOutcomes(clients[2], views[2])
        card = ModelCard(model_id=HELD, n_layers=2, storage_bytes=1000)
        answer = asyncio.create_task(outcomes.call(AddCustomCard(command_id="held", card=card)))
        await asyncio.wait_for(stale.holding.wait(), 20)

        # The stale master's lease runs out while it is paused (deleted here rather than waited
        # for), and the other master wins it and elects itself.
        await (await clients[2].jetstream().key_value(LEADER_BUCKET)).delete(LEADER_KEY)
        running.append(asyncio.create_task(new.run()))
        await eventually(lambda: views[0].state.leader_node == "new", 20)  # the stale master's own view knows
        new_term = views[0].state.leader_term
        stale.release.set()

        answered = await asyncio.wait_for(answer, 30)
        assert isinstance(answered, CustomCardAdded) and answered.term == new_term != stale_term

        last = await clients[2].jetstream().stream_info("EXO_EVENTS")
        for view in views:
            await view.wait_for(last.state.last_seq)
        folded, seen = await asyncio.to_thread(replay, fresh_nats, last.state.last_seq)
        fenced = [(seq, event, used) for seq, event, used in seen if seq > new_term and event.term == stale_term]
        assert any(isinstance(event, CustomCardAdded) and event.card.model_id == HELD for _, event, _ in fenced)
        assert not any(used for _, _, used in fenced)  # in the log, skipped by every fold
        added = collections.Counter(e.card.model_id for _, e, used in seen if used and isinstance(e, CustomCardAdded))
        assert added[HELD] == 1  # decided again by the new master, applied once
        assert all(isinstance(e, LeaderElected) or e.term == new_term for s, e, used in seen if used and s > new_term)
        assert views[0].state == views[1].state == views[2].state == folded
        assert folded.custom_model_cards[HELD] == card
    finally:
        for task in running:
            task.cancel()
        await asyncio.wait(running, timeout=10)
        for view in views:
            await view.stop()
        for nc in clients:
            await nc.close()
