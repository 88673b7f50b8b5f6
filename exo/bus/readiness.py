"""Whether this node's bus can serve, in words, for GET /health (a readiness probe): its connection
to NATS, the event stream writable (a leader and a quorum of current replicas), and State keeping
up with that stream. Load balancers ask often: the stream is asked at most once per PROBE_CACHE_S,
one question in flight whoever waits on it, and an answer slower than PROBE_TIMEOUT_S is a problem."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from nats.aio.client import Client
from nats.js.api import StreamInfo

from exo.bus.connection import disconnected_for
from exo.bus.errors import BROKER_ERRORS, BusError
from exo.bus.subjects import SHARED

PROBE_TIMEOUT_S = 1.0
PROBE_CACHE_S = 1.5
# A leader election among a majority can answer for a moment with too few current replicas (seen:
# 0.1 s); a stream whose answers say so this long has lost its quorum until servers return.
QUORUM_LOST_AFTER_S = 2.0
# A folded view may trail the stream by the events in flight; trailing the same sequence this long is stuck.
STATE_LAG_S = 10.0


def connection_problem(nc: Client) -> str:
    away = disconnected_for(nc)
    return "" if away is None else f"not connected to NATS since {away:.0f} s"


def quorum_problem(stream: str, wanted: int, leader: str | None, peers_current: list[bool]) -> str:
    """Why `stream` cannot take writes now ("" if it can): no leader, or fewer current replicas
    (the leader and its current peers) than a majority of the `wanted` ones."""
    current = (1 if leader else 0) + sum(peers_current)
    if leader and current >= wanted // 2 + 1:
        return ""
    no_leader = "no leader, " if not leader else ""
    return f"no quorum for {stream}: {no_leader}{current} of {wanted} replicas current"


def looks_quorumless(wanted: int, leader: str | None, peers_current: list[bool]) -> bool:
    """Fewer current replicas than a majority of the `wanted` ones: the quorum is lost until servers
    return, or (for a moment, without a leader) an election is under way: see QUORUM_LOST_AFTER_S."""
    return (1 if leader else 0) + sum(peers_current) < wanted // 2 + 1


class NoQuorum(BusError):
    """The event stream has lost its quorum: nothing appended to it is stored until servers return."""


@dataclass(frozen=True)
class StreamReadiness:
    problem: str  # "" while the stream takes writes
    last_seq: int  # its last sequence when it answered; -1 when it did not
    quorumless: bool = False  # it answered, with fewer current replicas than a majority (looks_quorumless)


def _readiness_of(stream: str, info: StreamInfo) -> StreamReadiness:
    cluster = info.cluster  # a lone server names itself leader, with no peers
    leader = cluster.leader if cluster is not None else "standalone"
    peers = [bool(peer.current) for peer in (cluster.replicas or [])] if cluster is not None else []
    wanted = info.config.num_replicas or 1
    return StreamReadiness(quorum_problem(stream, wanted, leader, peers), info.state.last_seq,
                           looks_quorumless(wanted, leader, peers))


class StreamProbe:
    """The event stream's readiness, asked of JetStream at most once per PROBE_CACHE_S."""

    def __init__(self, nc: Client, stream: str = SHARED.events_stream) -> None:
        self._nc = nc
        self._stream = stream
        self._answer: tuple[float, StreamReadiness] | None = None  # (time.monotonic(), answer)
        self._asking: asyncio.Task[StreamReadiness] | None = None
        self._quorumless_since: float | None = None  # the first of the answers in a row that looked quorumless

    async def lost_quorum(self) -> str:
        """The stream's problem once its answers have looked quorumless for QUORUM_LOST_AFTER_S; ""
        otherwise. While they have for less, it waits for the next answer (a few seconds at most)."""
        while True:
            answer = await self.readiness()
            since = self._quorumless_since
            if not answer.quorumless or since is None:
                return ""
            if time.monotonic() - since >= QUORUM_LOST_AFTER_S:
                return answer.problem
            await asyncio.sleep(PROBE_CACHE_S / 3)

    async def readiness(self) -> StreamReadiness:
        if self._answer is not None and time.monotonic() - self._answer[0] < PROBE_CACHE_S:
            return self._answer[1]
        if self._asking is None:
            self._asking = asyncio.create_task(self._ask(), name=f"{self._stream} readiness probe")
        return await asyncio.shield(self._asking)  # a caller that goes away leaves the answer to the others

    async def _ask(self) -> StreamReadiness:
        try:
            js = self._nc.jetstream(timeout=PROBE_TIMEOUT_S)
            info = await asyncio.wait_for(js.stream_info(self._stream), PROBE_TIMEOUT_S)
            answer = _readiness_of(self._stream, info)
            if not answer.quorumless:
                self._quorumless_since = None
            elif self._quorumless_since is None:
                self._quorumless_since = time.monotonic()
        except (TimeoutError, *BROKER_ERRORS) as error:  # type: ignore[misc]  # a tuple of exception types
            said = getattr(error, "description", None) or f"no answer within {PROBE_TIMEOUT_S:g} s"
            answer = StreamReadiness(f"JetStream cannot serve {self._stream}: {said}", -1)
        finally:
            self._asking = None
        self._answer = (time.monotonic(), answer)
        return answer


class LagWatch:
    """Whether a folded view keeps up with its log: behind the stream for a moment is normal (events
    land between the stream's answer and their fold); still short of a sequence seen STATE_LAG_S ago is not."""

    def __init__(self, allowed_s: float = STATE_LAG_S) -> None:
        self._allowed_s = allowed_s
        self._behind: tuple[int, float] | None = None  # (a last sequence the log had, when it was seen)

    def problem(self, folded: int, log_last: int, now: float) -> str:
        if self._behind is not None and folded >= self._behind[0]:
            self._behind = None
        if self._behind is None and log_last > folded:
            self._behind = (log_last, now)
        if self._behind is None or now - self._behind[1] <= self._allowed_s:
            return ""
        seen, when = self._behind
        return f"State is behind the event log: folded up to {folded}, the log held {seen} {now - when:.0f} s ago"
