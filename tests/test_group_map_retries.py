"""A lone shared master whose group map could not be written at the start of its term (JetStream too
slow to answer the group streams' creation, an operator's stream in the way) writes it once it can,
in the same term: no next election comes to write it, and without the map no group's master ever
campaigns (tests/test_master_groups.py's fixture waited 60 s for one). The same for a node's
following of a group's log, and for a lease that ran out while the term began."""

from __future__ import annotations

import asyncio
import time

from nats import errors as nats_errors

from exo.bus.cluster_view import ClusterView
from exo.bus.connection import connect
from exo.bus.event_log import EventLog
from exo.bus.leadership import Lease
from exo.bus.provision import provision
from exo.bus.state_view import StateView
from exo.core.events import GroupsSet, LeaderElected
from exo.master.service import Master
from exo.settings.services import MasterSettings
from tests.conftest import eventually

GROUPS = {"alpha": ["m/*"]}
SETTINGS = MasterSettings(groups="alpha=m/*")


async def stopped(master: asyncio.Task[None]) -> None:
    """Cancel a master and wait for it: none is left running (or failing unseen) after its test."""
    master.cancel()
    await asyncio.wait({master}, timeout=10)
    assert master.done()
    if not master.cancelled():
        master.exception()  # retrieved: a failure is the test's business, not the collector's log


async def in_the_way(nc) -> None:
    """An operator's stream with the name of group alpha's events stream: exo cannot make alpha's."""
    await nc.jetstream().add_stream(name="EXO_EVENTS_alpha", subjects=["operator.alpha"])


async def test_a_group_map_not_written_as_the_term_began_is_written_later_in_that_term(fresh_nats):
    nc = await connect([fresh_nats], name="map-retry")
    await provision(nc)
    await in_the_way(nc)
    view = StateView(nc)
    await view.start()
    running = asyncio.create_task(Master(nc, view, {}, node_id="m1", settings=SETTINGS).run())
    try:
        await eventually(lambda: view.state.leader_node == "m1", 20)
        term = view.state.leader_term
        await asyncio.sleep(1.5)  # a first try again, still in the way
        assert view.state.groups == {}
        await nc.jetstream().delete_stream("EXO_EVENTS_alpha")
        await eventually(lambda: view.state.groups == GROUPS, 15)
        assert view.state.leader_term == term and not running.done()  # written by this term, not a new one
        assert (await nc.jetstream().stream_info("EXO_EVENTS_alpha")).config.subjects != ["operator.alpha"]
    finally:
        await stopped(running)
        await view.stop()
        await nc.close()


class PausedAsTermBegins(Master):
    """Its lease runs out (a pause past its validity, on the lease's own clock) as its first term
    writes the group map."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.paused_s = 0.0
        self._lease = Lease(self._nc, self._node_id, clock=lambda: time.monotonic() + self.paused_s)

    async def _name_groups(self, term: int) -> bool:
        if not self.paused_s:
            self.paused_s = self._lease.ttl
        return await super()._name_groups(term)


async def test_a_lease_that_ran_out_as_the_term_began_is_campaigned_for_again(fresh_nats):
    nc = await connect([fresh_nats], name="paused-master")
    await provision(nc)
    view = StateView(nc)
    await view.start()
    master = PausedAsTermBegins(nc, view, {}, node_id="m1", settings=SETTINGS)
    running = asyncio.create_task(master.run())
    try:
        await eventually(lambda: view.state.groups == GROUPS or running.done(), 20)
        assert not running.done(), running.exception()
        assert master.paused_s > 0 and view.state.leader_node == "m1" and view.state.leader_term > 1
    finally:
        await stopped(running)
        await view.stop()
        await nc.close()


async def test_a_group_log_that_could_not_be_followed_is_followed_once_it_can_be(fresh_nats):
    nc = await connect([fresh_nats], name="follow-retry")
    await provision(nc)
    await in_the_way(nc)
    shared = StateView(nc)
    await shared.start()
    cluster = ClusterView(nc, shared)
    try:
        log = EventLog(nc)  # as a shared master would: its election, then the map (whose streams are in the way here)
        term = await log.append(LeaderElected(node_id="m1", lease_revision=1), event_id="e")
        await shared.wait_for(await log.append(GroupsSet(groups=GROUPS, term=term), event_id="g"))
        assert shared.state.groups == GROUPS
        await asyncio.sleep(1.5)  # a first try again, still in the way
        assert cluster.groups == {}
        await nc.jetstream().delete_stream("EXO_EVENTS_alpha")
        await eventually(lambda: "alpha" in cluster.groups, 15)
        assert cluster.groups["alpha"].names.events_stream == "EXO_EVENTS_alpha"
    finally:
        await cluster.stop()
        await nc.close()


class SwallowingLease(Lease):
    """A lease whose broker call swallows the task's cancellation and fails as a broker error, as
    nats-py does in places (its flush passes on CancelledError; its async publish turns one into
    TooManyStalledMsgsError)."""

    entered = asyncio.Event()

    async def try_acquire(self) -> int | None:
        self.entered.set()
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            pass
        raise nats_errors.TimeoutError


async def test_a_master_campaigning_again_after_broker_errors_still_stops_when_cancelled(fresh_nats):
    # The master's loop catches broker errors and campaigns again; a cancellation a broker call
    # swallowed must still end it (one kept a test session from ending: its teardown waited 300 s).
    nc = await connect([fresh_nats], name="cancelled-master")
    await provision(nc)
    view = StateView(nc)
    await view.start()
    master = Master(nc, view, {}, node_id="m1", settings=SETTINGS)
    master._lease = lease = SwallowingLease(nc, master._node_id)
    running = asyncio.create_task(master.run())
    try:
        await asyncio.wait_for(lease.entered.wait(), 5)  # campaigning: inside the broker call now
        running.cancel()
        done, _ = await asyncio.wait({running}, timeout=5)
        assert done and running.cancelled()
    finally:
        await stopped(running)
        await view.stop()
        await nc.close()
