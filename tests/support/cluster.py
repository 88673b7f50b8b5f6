"""Helpers for tests that run several exo processes against one real nats-server."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path

import httpx

from exo.bus.connection import connect
from exo.bus.event_log import EventFollower
from exo.bus.server.embedded import EmbeddedNats
from exo.core.apply import apply, skip_event, was_skipped
from exo.core.event_signers import SignatureCheck
from exo.core.events import AnyEvent
from exo.core.state import State, decode_state
from exo.resources import streams_dir
from tests.support.exo_process import ExoProcess
from tests.support.polling import wait_until as wait_until  # where tests import it from


class NatsServer:
    """A nats-server of the test's own (sync API), restartable on the same port and store."""

    def __init__(self, store: Path) -> None:
        self.server = EmbeddedNats(store, port=0)
        self.url = asyncio.run(self.server.start())

    def stop(self) -> None:
        self.server.stop()


def start_node(root: Path, name: str, nats_url: str, *flags: str, env: dict[str, str] | None = None) -> ExoProcess:
    return node_process(root, name, nats_url, *flags, env=env).start()


def node_process(root: Path, name: str, nats_url: str, *flags: str, env: dict[str, str] | None = None) -> ExoProcess:
    """start_node's process, not started yet: for exo_process.start_all."""
    return ExoProcess(root / name, env or {}, ["--nats", nats_url, *flags])


def state_of(node: ExoProcess) -> State:
    return state_of_url(node.url)


def state_of_url(api_url: str) -> State:
    return decode_state(httpx.get(f"{api_url}/state", timeout=30).content)


def log_line(node: ExoProcess, pattern: str) -> re.Match[str] | None:
    return re.search(pattern, node.output())


def replay(nats_url: str | list[str], upto: int) -> tuple[State, list[tuple[int, AnyEvent, bool]]]:
    """Fold the log from sequence 1 to `upto`; also says, per event, whether it was applied."""

    async def run() -> tuple[State, list[tuple[int, AnyEvent, bool]]]:
        nc = await connect(nats_url if isinstance(nats_url, list) else [nats_url], name="test-replay")
        state = State()
        seen: list[tuple[int, AnyEvent, bool]] = []
        done = asyncio.get_running_loop().create_future()

        async def on_event(seq: int, event: AnyEvent, verify: SignatureCheck) -> None:
            nonlocal state
            if seq > upto:  # events appended since (heartbeats) still arrive until the follower stops
                return
            state = apply(state, event, seq, verify)
            seen.append((seq, event, not was_skipped(state, seq)))
            if seq >= upto and not done.done():
                done.set_result(None)

        async def on_undecodable(seq: int, reason: str) -> None:
            nonlocal state
            if seq <= upto:
                state = skip_event(state, seq, reason)
            if seq >= upto and not done.done():
                done.set_result(None)

        follower = EventFollower(nc, on_event, on_undecodable)
        await follower.start(1)
        await asyncio.wait_for(done, 120)
        await follower.stop()
        await nc.close()
        return state, seen

    return asyncio.run(run())


def quick_takeover_streams(folder: Path, ttl_s: int = 5) -> dict[str, str]:
    """The env of nodes on the shipped streams (copied into `folder`) but for the master's lease TTL
    and its command consumer's ack wait, `ttl_s` each instead of 10 s: a killed master's place is
    taken, and the command it had taken redelivered, sooner. The master renews every TTL/5 and holds
    the lease 0.6 TTL past a renewal, whatever the TTL, so only the waits shrink."""
    shutil.copytree(streams_dir(), folder)
    for file, fields in (("KV_exo-leader.json", ("max_age", "duplicate_window")),
                         ("consumers/EXO_COMMANDS.exo-master.json", ("ack_wait",))):
        config = json.loads((folder / file).read_text())
        (folder / file).write_text(json.dumps(config | dict.fromkeys(fields, ttl_s * 1_000_000_000)))
    return {"EXO_STREAMS_DIR": str(folder)}
