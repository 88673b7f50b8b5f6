"""The master: win the lease, then receive the waiting commands, decide each, append its events,
wait until State has them, ack. Snapshots of State go to the KV bucket while it leads.

Commands come in batches of those already waiting: each is decided on State plus the events this
master appended for the batch so far (folded here, ahead of the view), and the batch is acked
once State holds its events and still names this master's term."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import cast

from msgspec.structs import replace

from exo.bus import broker_trouble
from exo.bus.atomic_append import AtomicAppendFailed
from exo.bus.cache_reports import listen_for_cache_reports
from exo.bus.chunk_signing import ChunkSigner
from exo.bus.command_queue import NotLeader, RetryBatch, consume_commands
from exo.bus.connection import Connection
from exo.bus.errors import BROKER_ERRORS, BusError, raise_if_cancelled
from exo.bus.event_log import EventLog
from exo.bus.leadership import Lease
from exo.bus.liveness import Pulse, listen_for_pulses
from exo.bus.provision import provision_group
from exo.bus.state_view import StateView
from exo.bus.subjects import group_names
from exo.bus.throttled_log import ThrottledLog
from exo.core.apply import apply
from exo.core.cache_reports import CacheReport
from exo.core.commands import AnyCommand, command_tag
from exo.core.events import (
    AnyEvent,
    CommandRejected,
    Event,
    LeaderElected,
    NodeHeartbeat,
    NodeRegistered,
    NodeTimedOut,
    event_tag,
)
from exo.core.groups import for_group, parse_groups
from exo.core.ids import CommandId, ModelId, NodeId
from exo.core.keys import ApiKey
from exo.core.state import State
from exo.core.types import ModelCard
from exo.master.adapter_sweep import sweep_adapter_weights_while
from exo.master.autoscale import ScalePolicy
from exo.master.cache_view import CacheView
from exo.master.decide import decide
from exo.master.group import groups_to_set, heal_group, key_copy, not_for_group
from exo.master.heal import HealLimits
from exo.master.lifecycle_log import LifecycleLog
from exo.master.memo import DecideMemo
from exo.master.snapshotter import Snapshotter
from exo.master.supervise import supervision_round
from exo.settings.services import MasterSettings
from exo.telemetry import tracing

log = logging.getLogger(__name__)

ONE_BY_ONE_S = 60.0  # after an atomic batch was refused: how long commands append their own events
NAMING_RETRY_MAX_S = 30.0  # the longest wait between tries of a group map that could not be written

_ID_NAMESPACE = uuid.UUID("6f1c4a52-3c1e-4e43-9d55-0b6f8f0f2a10")


def ids_for(command_id: CommandId) -> Iterator[str]:
    """Ids derived from the command, so a redelivered command decides the very same events."""
    return (uuid.uuid5(_ID_NAMESPACE, f"{command_id}/{n}").hex for n in itertools.count())


class Master:
    def __init__(
        self, nc: Connection, view: StateView, builtin_cards: Mapping[ModelId, ModelCard], node_id: NodeId,
        settings: MasterSettings = MasterSettings(), shared: StateView | None = None, signer: ChunkSigner | None = None,
    ) -> None:
        """`view` follows this master's own log: the shared one, or (with `shared`, the shared
        log's view) a master group's, whose requests it decides on both (exo/core/groups.py).
        `signer` (the node's key) signs its snapshots; its public half goes into its elections."""
        self._settings = settings
        self._nc = nc
        self._view = view
        self._shared = shared
        self._names = view.names
        self._wanted_groups = parse_groups(settings.groups) if shared is None else {}
        self._log = EventLog(nc, self._names, signer)  # its decisions are signed: exo/core/event_signers.py
        self._builtin_cards = builtin_cards
        self._lease = Lease(nc, node_id, key=self._names.leader_key)
        self._node_id = node_id
        self._snapshotter = Snapshotter(nc, view, settings.snapshot_every, settings.snapshot_interval_s, signer)
        self._public_key = signer.public_key if signer is not None else ""
        self._copied_keys: dict[str, ApiKey] = {}  # a group's: the keys its log has copies of
        self._node_timeout = settings.node_timeout_s
        self._heal = HealLimits(suspect_s=settings.suspect_s, deadline_s=settings.migration_deadline_s,
                                max_migrations=settings.max_migrations, load_timeout_s=settings.load_timeout_s)
        self._scale = ScalePolicy(queue=settings.scale_queue, window_s=settings.scale_window_s,
                                  idle_s=settings.scale_idle_s)
        self._heard_at: dict[NodeId, float] = {}  # node id -> time.monotonic() of its latest heartbeat seen
        self._caches = CacheView()  # what runners last said their prompt caches hold: routing's hint
        view.add_listener(self._on_event)
        self._lifecycle = LifecycleLog(view.state, self._lease.valid)
        view.add_listener(self._lifecycle.on_event)
        self.term = 0
        self._renew_at = math.inf  # when the term in progress is renewed (EXO_MASTER_TERM_RENEW_S)
        self._ahead: State | None = None  # State plus this batch's own events, until the view has them
        self._memo = DecideMemo()  # kept across decisions: saves scans of every task and instance per request
        self._staged: list[tuple[Event, str]] = []  # this batch's decided events and their ids, not yet appended
        self._staged_traces: dict[str, str] = {}  # staged event id -> the traced decision (exo/telemetry) that made it
        self._one_by_one_until = 0.0  # time.monotonic() until which commands append their events one by one
        self._campaigns = ThrottledLog(log)  # with the bus away a campaign fails every few seconds: a line a minute

    def _on_event(self, seq: int, event: AnyEvent, state: State) -> None:
        if isinstance(event, (NodeRegistered, NodeHeartbeat)):
            self._heard_at[event.node.node_id] = time.monotonic()

    def _on_pulse(self, pulse: Pulse) -> None:
        self._heard_at[pulse.node_id] = time.monotonic()

    def _on_cache_report(self, report: CacheReport) -> None:
        if self._settings.cache_reports and not self._caches.accept(self._laid_over(self._view.state), report):
            log.debug("master: cache report of instance %s from %s ignored: not where its rank 0 runs",
                      report.instance_id, report.node_id)

    async def run(self) -> None:
        """Campaign for the lease until this node wins it, lead until it is lost, repeat. Pulses
        are heard all along, so a node that takes over knows who is alive."""
        # Pulses tell the shared master who is alive; a group's master leaves that to it.
        pulses = await listen_for_pulses(self._nc, self._on_pulse) if self._shared is None else None
        cache_reports = await listen_for_cache_reports(self._nc, self._on_cache_report)
        try:
            while True:
                try:
                    if await self._lease.try_acquire() is None:
                        self._campaign_worked()
                        await asyncio.sleep(self._lease.ttl / 5)
                        continue
                    await self._lead()
                except (TimeoutError, NotLeader, *BROKER_ERRORS) as error:  # type: ignore[misc]  # a tuple of exception types
                    # The broker is changing leaders or we are reconnecting, or the lease ran out
                    # while this term began (a pause): campaign again.
                    raise_if_cancelled()
                    self._campaigns.warning("campaign", "master%s: %r; campaigning again", self._group_label, error)
                    await asyncio.sleep(1)
        finally:
            if pulses is not None:
                await pulses.unsubscribe()
            await cache_reports.unsubscribe()
            await self._lease.release()

    async def _lead(self) -> None:
        revision = self._lease.term
        if not self._lease.valid():
            return
        # The term is this election's sequence in the log (see LeaderElected): a new election on
        # every campaign, so one that a forged election displaced takes over again at once.
        seq = await self._log.append(LeaderElected(node_id=self._node_id, lease_revision=revision, public_key=self._public_key),
                                     event_id=f"leader:{revision}:{uuid.uuid4().hex[:8]}")
        await self._view.wait_for(seq)
        if self._view.state.leader_term != seq:
            return  # a newer election came meanwhile
        term = self.term = seq
        self._renew_at = time.monotonic() + self._settings.term_renew_s
        self._ahead, self._staged = None, []
        self._memo = DecideMemo()  # what it saw of earlier terms' States is not carried into this one
        await self._log.check_atomic()
        self._copied_keys = dict(self._view.state.api_keys)
        named = await self._name_groups(term)
        self._campaign_worked()
        log.info("master%s: leading with term %d", self._group_label, term)
        background = [asyncio.create_task(self._keep_lease()),
                      asyncio.create_task(self._snapshotter.run(self._lease.valid)),
                      asyncio.create_task(self._supervise(term))]
        if not named:
            background.append(asyncio.create_task(self._name_groups_until_written(term)))
        if self._shared is None and self._settings.adapter_sweep_s > 0:  # adapters are the shared log's
            background.append(asyncio.create_task(sweep_adapter_weights_while(
                lambda: self._still_leading(term), self._nc, lambda: self._view.state,
                self._settings.adapter_sweep_s, self._settings.adapter_sweep_grace_s)))
        try:
            await consume_commands(self._nc, self.handle, lambda: self._still_leading(term), self.give_up, self.confirm,
                                   self._names)
        finally:
            for task in background:
                task.cancel()
            self.term = 0
            renewing = time.monotonic() >= self._renew_at  # EXO_MASTER_TERM_RENEW_S: it elects itself again
            (log.info if renewing else log.warning)("master%s: %s (term %d)", self._group_label,
                                                    "renewing its term" if renewing else "no longer leading", term)

    @property
    def _group_label(self) -> str:
        return f" of group {self._names.group}" if self._names.group else ""

    def _campaign_worked(self) -> None:
        """A campaign reached the bus (lost to another node, or won): after failed ones, said once."""
        self._campaigns.cleared("campaign", "master%s: campaigning works again", self._group_label)

    async def _name_groups(self, term: int) -> bool:
        """The shared master: the group map of its settings into the log, each group's streams first.
        False while the streams cannot be made: the map stays as the log has it, for now."""
        events = groups_to_set(self._wanted_groups, self._view.state) if self._shared is None else []
        try:
            for group in self._wanted_groups if events else ():
                await provision_group(self._nc, group_names(group))
        except BusError as error:  # JetStream too slow to answer, or an operator's stream of that name
            log.error("master: the group map of EXO_MASTER_GROUPS is not written (yet): %s", error)
            return False
        await self._append_all(events, term, f"groups:{term}")
        return True

    async def _name_groups_until_written(self, term: int) -> None:
        """Try the map again while this term lasts: a lone master has no next term to write it in,
        and without the map no group's master ever campaigns."""
        delay = 1.0
        while self._still_leading(term):
            await asyncio.sleep(delay)
            try:
                if await self._name_groups(term):
                    return
            except (TimeoutError, NotLeader, *BROKER_ERRORS) as error:  # type: ignore[misc]  # as in run
                log.warning("master: the group map is not appended: %r", error)
            delay = min(delay * 2, NAMING_RETRY_MAX_S)

    def _still_leading(self, term: int) -> bool:
        """The lease is ours, the log's latest election is ours (else: campaign, and elect again) and
        the term is not due for renewal: an election older than the log's retention would leave no
        signer of snapshots to check (exo/core/snapshot_trust.py); the lease is kept meanwhile."""
        return self._lease.valid() and self._view.state.leader_term == term and time.monotonic() < self._renew_at

    async def _keep_lease(self) -> None:
        while await self._lease.renew():  # noqa: ASYNC110  # periodic renewal, not polling
            await asyncio.sleep(self._lease.ttl / 5)

    async def _supervise(self, term: int) -> None:
        """Time out silent nodes and retire failing instances, about once a second while leading."""
        interval, last_tick = min(1.0, self._node_timeout / 4), time.monotonic()
        while self._lease.valid():
            await asyncio.sleep(interval)
            if self._shared is not None:
                await self._heal_group(term)
                continue
            state, now = self._view.state, time.monotonic()
            # This loop itself stalled (a long GC, a starved machine): the pulses queued meanwhile
            # are not read yet, so silence proves nothing this time round. Nor does silence while
            # the broker was in trouble (a server gone, a stream between leaders): a node's pulses
            # may be held up by the same trouble, so it gets a full suspect window after it.
            troubled = now - broker_trouble.last() < self._heal.suspect_s
            stalled, last_tick = now - last_tick > 2.5 * interval, now
            events = supervision_round(state, self._heard_at, now, time.time(), node_timeout=self._node_timeout,
                                       limits=self._heal, builtin=self._builtin_cards, scale=self._scale,
                                       ids=ids_for(CommandId(f"heal:{term}:{state.last_seq}")), quiet=stalled or troubled)
            try:
                await self._append_all(events, term, f"supervise:{term}:{state.last_seq}")
            except (TimeoutError, *BROKER_ERRORS, NotLeader) as error:  # type: ignore[misc]  # as above
                log.warning("master: supervision events not appended: %r", error)
            for event in events:
                if isinstance(event, NodeTimedOut):
                    self._heard_at.pop(event.node_id, None)

    async def _append_all(self, events: list[Event], term: int, id_prefix: str) -> None:
        appended = await self._append(events, term, id_prefix)
        if appended:
            # The next decision must see these events, whoever else appended meanwhile.
            await self._view.wait_for(appended[-1][0])

    async def _append(self, events: list[Event], term: int, id_prefix: str) -> list[tuple[int, Event]]:
        """Append in order; each event's sequence with the event as appended."""
        appended: list[tuple[int, Event]] = []
        for n, event in enumerate(events):
            if not self._lease.valid():
                raise NotLeader()
            event = replace(event, term=term)
            with tracing.span("exo.events.append", kind="producer") as appending:  # in a traced decision only
                appended.append((await self._log.append(event, f"{id_prefix}:{n}", appending.traceparent), event))
        return appended

    async def give_up(self, command: AnyCommand, error: str) -> None:
        """A command whose handling kept failing: answer its caller with the error, once."""
        term = self.term  # appended now, ahead of the batch's staged events: a rejection changes no State they read
        rejected = CommandRejected(command_id=command.command_id, command_kind=command_tag(command), code="unavailable",
                                   reason=f"the master could not handle this command: {error}")
        await self._append_all([rejected], term, f"{command.command_id}:{term}:failed")
        if self._view.state.leader_term != term:
            raise NotLeader()

    async def handle(self, command: AnyCommand) -> None:
        """Decide one command on State plus the batch's decisions so far. Its events are staged for
        `confirm` to append with the batch's (one atomic batch), or appended now where the stream takes
        no atomic batches or one was refused lately (a bad event then fails its own command)."""
        if not self._lease.valid():
            raise NotLeader()
        term = self.term
        state = self._deciding_state()
        events = self._refused_here(state, command) or [*self._group_events(state, command), *decide(
            state, command, builtin_cards=self._builtin_cards, ids=ids_for(command.command_id),
            cache_routing=self._settings.cache_routing, default_max_queue=self._settings.max_queue,
            memo=self._memo, on_demand=self._settings.on_demand, keep_alive_s=self._settings.keep_alive_s,
            cache_dropped=self._caches.dropped, adapters_share_base=self._settings.adapters_share_base, heal=self._heal,
        )]
        if not self._log.atomic or time.monotonic() < self._one_by_one_until:
            self._ahead = await self._append_folding(state, events, term, f"{command.command_id}:{term}")
            return
        trace = tracing.current_traceparent()  # the decision's span (command_queue): its events carry it on
        for n, event in enumerate(events):
            event = replace(event, term=term)
            self._staged.append((event, f"{command.command_id}:{term}:{n}"))
            if trace:
                self._staged_traces[f"{command.command_id}:{term}:{n}"] = trace
            # Folded here, ahead of the view, at the sequence it gets if nothing comes between.
            state = apply(state, cast(AnyEvent, event), state.last_seq + 1)
        self._ahead = state

    async def _append_folding(self, state: State, events: list[Event], term: int, id_prefix: str) -> State:
        for seq, event in await self._append(events, term, id_prefix):
            if seq == state.last_seq + 1:  # nothing came between: fold it here, ahead of the view
                state = apply(state, cast(AnyEvent, event), seq)
            elif seq > state.last_seq:  # others' events came between (a task finished...): the view has them
                state = self._laid_over(await self._view.wait_for(seq))
        return state

    async def confirm(self) -> None:
        """The commands handled since the last confirm may be acked: their events are appended, State
        holds them and still names this master's term (else they were fenced off: the new master
        decides them)."""
        term = self.term
        await self._commit_staged(term)
        if self._ahead is not None:
            await self._view.wait_for(self._ahead.last_seq)
            self._ahead = None
        if self._view.state.leader_term != term:
            raise NotLeader()

    async def _commit_staged(self, term: int) -> None:
        """Append the staged events: one atomic batch, one round trip (exo/bus/atomic_append.py). One
        not confirmed ends this term (NotLeader): it may have landed, and only a new election tells
        which decisions count."""
        staged, self._staged = self._staged, []
        traces, self._staged_traces = self._staged_traces, {}
        if not staged:
            return
        if not self._lease.valid():
            self._ahead = None
            raise NotLeader()
        planned_first = self._ahead.last_seq - len(staged) + 1 if self._ahead is not None else 0
        try:
            with tracing.spans("exo.events.append", traces) as appending:
                seqs = await self._log.append_all(staged, appending)
        except AtomicAppendFailed as error:
            self._ahead = None
            if error.stored_none:  # none stored: decide the batch again, appending command by command
                log.warning("master: the batch of %d events was refused (%s); appending one command's events at a "
                            "time for %.0f s", len(staged), error, ONE_BY_ONE_S)
                self._one_by_one_until = time.monotonic() + ONE_BY_ONE_S
                self._copied_keys = dict(self._view.state.api_keys)  # the batch's key copies were not stored
                raise RetryBatch() from error
            log.warning("master: the batch of %d events was not confirmed (%s); electing again", len(staged), error)
            raise NotLeader() from error
        if seqs[0] != planned_first or seqs != list(range(seqs[0], seqs[0] + len(seqs))):
            # Others' events came between (a task finished...): the view has the log's order.
            self._ahead = None
            await self._view.wait_for(seqs[-1])

    def _deciding_state(self) -> State:
        """State as this master's own recent events left it: while a batch is staged, State as the batch
        began plus its decisions (their sequences are only planned: the view may already have folded
        others' events at them); else the view, unless it has yet to fold what this master appended."""
        view = self._view.state
        if self._ahead is not None and (self._staged or self._ahead.last_seq > view.last_seq):
            return self._ahead
        return self._laid_over(view)

    def _laid_over(self, own: State) -> State:
        """A group's State as its master decides on it: laid over the shared State."""
        return own if self._shared is None else for_group(self._shared.state, own)

    def _refused_here(self, state: State, command: AnyCommand) -> list[Event]:
        return [] if self._shared is None else not_for_group(state, command)

    def _group_events(self, state: State, command: AnyCommand) -> list[Event]:
        if self._shared is None or command.command_id in state.answered_commands:
            return []
        return key_copy(self._shared.state.api_keys, self._copied_keys, command)

    async def _heal_group(self, term: int) -> None:
        """A group's supervision: its requests whose instance the shared master ended move on."""
        state = self._laid_over(self._view.state)
        events = heal_group(state, time.time(), self._heal)
        try:
            await self._append_all(events, term, f"heal:{term}:{state.last_seq}")
        except (TimeoutError, *BROKER_ERRORS, NotLeader) as error:  # type: ignore[misc]  # as in _supervise
            log.warning("master of group %s: healing events not appended: %r", self._names.group, error)
        for event in events:
            log.warning("master of group %s: %s %s", self._names.group, event_tag(event), getattr(event, "reason", ""))
