"""Many simulated worker nodes in one process, for the scale simulator (bench/scale.py) and its test.

Each node is the real worker code (exo/worker/service.py and runners.py: plan, runner lifecycle, task
forwarding, events) and the real heartbeat (pulses on core NATS, described in the log when it
changes), with FakeRunner at its edge instead of a model process. The nodes share one NATS
connection and one State follower: on real machines every node folds the log itself, in
parallel; here one fold stands for all of them, and each event is handed only to the nodes it
concerns (exo/worker/plan.py::nodes_concerned), as each real node's worker would skip the rest.

Run as a process: python -m tests.support.simulated_nodes --nats URL --nodes N --data-dir D
It prints "simulated nodes ready" once every node is registered, and answers the core NATS
request "exo.sim.seq" with the last sequence its State has folded (the bench's lag probe).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path

from nats.aio.msg import Msg

from exo.bus.catch_up import catch_up
from exo.bus.cluster_view import ClusterView
from exo.bus.connection import Connection, connect
from exo.bus.event_log import EventLog
from exo.bus.liveness import Pulse, send_pulse
from exo.bus.state_view import Listener
from exo.bus.subjects import LogNames
from exo.core.events import AnyEvent, Event, NodeRegistered
from exo.core.ids import NodeId, RunnerId, TaskId
from exo.core.state import State
from exo.models.dirs import DownloadSettings
from exo.settings.services import ModelSettings
from exo.worker.heartbeat import Heartbeat
from exo.worker.node_info import describe_this_node
from exo.worker.plan import nodes_concerned
from exo.worker.service import Worker
from tests.support.fake_runner import FakeRunner

SEQ_PROBE = "exo.sim.seq"


class NodeScopedView:
    """What one simulated node's worker sees of the shared follower: its State, and only the
    events that concern the node."""

    def __init__(self, shared: SharedView, node_id: NodeId) -> None:
        self._shared = shared
        self._node_id = node_id

    @property
    def state(self) -> State:
        return self._shared.view.state

    def add_listener(self, listener: Listener) -> None:
        self._shared.listeners[self._node_id].append(listener)

    def names_for_model(self, model_id: str) -> LogNames:
        return self._shared.view.names_for_model(model_id)

    def names_for_task(self, task_id: TaskId) -> LogNames:
        return self._shared.view.names_for_task(task_id)


class SharedView:
    def __init__(self, view: ClusterView) -> None:
        self.view = view
        self.listeners: defaultdict[NodeId, list[Listener]] = defaultdict(list)
        view.add_listener(self._dispatch)

    async def _dispatch(self, seq: int, event: AnyEvent, state: State) -> None:
        concerned = nodes_concerned(state, event)
        for node_id in self.listeners if concerned is None else concerned:
            for listener in self.listeners.get(node_id, ()):
                try:
                    result = listener(seq, event, state)
                    if result is not None:
                        await result
                except Exception:  # as StateView does: one node's failure must not keep the event from the rest
                    logging.exception("simulated node %s: listener failed on event %d", node_id, seq)


class SimulatedNodes:
    def __init__(self, nats_url: str, count: int, data_root: Path, delay_s: float = 0.005, chunks: int = 4,
                 first: int = 0) -> None:
        self.nats_url = nats_url
        self.node_ids = [NodeId(f"sim-{i:04d}") for i in range(first, first + count)]
        self.data_root = data_root
        self.delay_s = delay_s
        self.chunks = chunks
        self.workers: list[Worker] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.nc: Connection | None = None
        self.shared: SharedView | None = None

    async def start(self) -> None:
        self.nc = nc = await connect([self.nats_url], name="exo-simulated-nodes")
        shared_log, _ = await catch_up(nc)
        view = ClusterView(nc, shared_log)
        await view.follow_groups()  # master groups' logs too (bench/groups.py)
        self.shared = SharedView(view)
        events = EventLog(nc)

        async def append(event: Event) -> None:
            await events.append(event, uuid.uuid4().hex)

        for node_id in self.node_ids:
            await self._start_node(nc, node_id, append)
        await nc.subscribe(SEQ_PROBE, cb=self._answer_seq)
        await nc.flush()

    async def _start_node(self, nc: Connection, node_id: NodeId, append: Callable[[Event], Awaitable[None]]) -> None:
        assert self.shared is not None
        data_dir = self.data_root / node_id
        scoped = NodeScopedView(self.shared, node_id)
        settings = DownloadSettings.of(ModelSettings(offline=True, model_sharing=False), data_dir)

        def fake_runner(runner_id: RunnerId) -> FakeRunner:
            return FakeRunner(runner_id, nc, self.delay_s, self.chunks)

        worker = Worker(nc, scoped, node_id, data_dir, [self.nats_url], {}, settings, runner_factory=fake_runner)

        async def pulse(incarnation: str) -> None:
            await send_pulse(nc, Pulse(node_id=node_id, incarnation=incarnation))

        heartbeat = Heartbeat(node_id, append, pulse, prompt_caches=worker.prompt_caches)
        scoped.add_listener(heartbeat.on_event)
        await append(NodeRegistered(node=describe_this_node(node_id, heartbeat.incarnation, time.time())))
        self.workers.append(worker)
        self._tasks += [asyncio.create_task(worker.run()), asyncio.create_task(heartbeat.run())]

    async def _answer_seq(self, msg: Msg) -> None:
        assert self.shared is not None
        await msg.respond(str(self.shared.view.state.last_seq).encode())

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for worker in self.workers:
            worker.kill_runners()
        if self.shared is not None:
            await self.shared.view.stop()
        if self.nc is not None:
            await self.nc.close()


async def _main(args: argparse.Namespace) -> None:
    nodes = SimulatedNodes(args.nats, args.nodes, Path(args.data_dir), args.delay_ms / 1000, args.chunks, args.first)
    await nodes.start()
    print("simulated nodes ready", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nats", required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--first", type=int, default=0, help="number of the first node (several simulator processes)")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--delay-ms", type=float, default=5.0)
    parser.add_argument("--chunks", type=int, default=4)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
