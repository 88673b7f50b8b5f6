"""A client that lost its NATS server says so once and says once that it is back, however many
retries lie between; a repeated error is said at most once a minute with a count; it does not
retry other servers with credentials they refuse, yet fails over where the cluster shares them;
and /events while NATS is away answers 503 without a traceback in the log. Real nats-servers
(exo's embedded one, or a two-server cluster of plain ones), stopped under the client."""

from __future__ import annotations

import asyncio
import gc
import logging
import re
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from aiohttp.test_utils import TestServer

from exo.api.app import build_app
from exo.api.context import ApiContext
from exo.api.outcomes import CommandOutcomes
from exo.bus.catch_up import catch_up
from exo.bus.connection import Connection, connect, disconnected_for
from exo.bus.provision import provision
from exo.bus.server.embedded import EmbeddedNats, nats_server_binary
from exo.bus.throttled_log import ThrottledLog
from exo.core.ids import NodeId
from exo.models.cards import load_builtin_cards
from exo.resources import builtin_cards_dir
from exo.settings.services import NatsSecurity
from tests.support.exo_process import free_port
from tests.support.polling import eventually, wait_until

CONNECTION_LOG = "exo.bus.connection"


def said(caplog: pytest.LogCaptureFixture, level: int, logger: str = CONNECTION_LOG) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno == level]


@pytest.mark.slow  # ten seconds without a server
async def test_a_lost_server_is_one_warning_and_its_return_one_info_however_many_retries_lie_between(
        fresh_server: EmbeddedNats, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=CONNECTION_LOG)
    nc = await connect([fresh_server.url], "exo-test")
    try:
        fresh_server.stop()
        await asyncio.sleep(10)
        retries = said(caplog, logging.DEBUG)
        assert len(retries) >= 10, retries  # a retry every half second, each only at DEBUG
        [lost] = said(caplog, logging.WARNING)
        assert re.fullmatch(rf"nats \(exo-test\): lost its server \((nats: unexpected EOF|\[Errno 104\] .*)\); "
                            rf"retrying nats://127\.0\.0\.1:{fresh_server.port}", lost), lost
        assert said(caplog, logging.INFO) == []

        await fresh_server.start()  # the same port and store
        await eventually(lambda: nc.is_connected, timeout=10, what="reconnected")
        [back] = said(caplog, logging.INFO)
        assert re.fullmatch(rf"nats \(exo-test\): reconnected to nats://127\.0\.0\.1:{fresh_server.port} "
                            r"after 1\d\.\d s", back), back
        assert len(said(caplog, logging.WARNING)) == 1 and said(caplog, logging.ERROR) == []
    finally:
        await nc.close()


async def test_an_error_repeated_while_connected_is_said_once_within_the_minute(
        fresh_server: EmbeddedNats, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=CONNECTION_LOG)
    operator = await connect([fresh_server.operator_url], "exo-test")  # read-only: a publish is refused
    try:
        for _ in range(5):
            await operator.publish("exo.not.allowed", b"")
            await operator.flush()
        await eventually(lambda: len(said(caplog, logging.DEBUG)) == 5, what="five refusals")
        assert said(caplog, logging.WARNING) == [
            "nats (exo-test): nats: permissions violation for publish to \"exo.not.allowed\""]
        assert operator.is_connected
    finally:
        await operator.close()


def test_a_repeated_condition_is_said_at_once_then_at_most_once_a_minute_with_its_count(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [1000.0]
    throttled = ThrottledLog(logging.getLogger("test.throttled"), clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="test.throttled")
    for at in (0.0, 1.0, 30.0, 59.9):
        now[0] = 1000.0 + at
        throttled.warning("away", "server away: %s", f"try at {at}")
    throttled.warning("other", "another condition")  # a condition of its own is said at once
    now[0] = 1061.0
    throttled.warning("away", "server away: %s", "try at 61")
    now[0] = 1062.0
    throttled.warning("away", "server away: %s", "try at 62")  # within a minute of the last line
    throttled.forget("away")  # it cleared: the next time is news
    throttled.warning("away", "server away: %s", "again")
    assert [r.getMessage() for r in caplog.records] == [
        "server away: try at 0.0",
        "another condition",
        "server away: try at 61 (4 times in the 61 s since the last such line)",
        "server away: again",
    ]


class TwoServerCluster:
    """Two plain nats-servers routed into one cluster, each with its own user and password:
    each advertises the other's client URL to its clients (INFO connect_urls)."""

    def __init__(self, root: Path, passwords: tuple[str, str]) -> None:
        self.ports = [free_port() for _ in range(4)]  # client A, client B, route A, route B
        self.monitors = [free_port(), free_port()]
        self.processes: list[subprocess.Popen[bytes]] = []
        for i, password in enumerate(passwords):
            other_route = self.ports[3 - i]
            config = root / f"server{i}.conf"
            config.write_text(
                f'listen: "127.0.0.1:{self.ports[i]}"\nhttp: "127.0.0.1:{self.monitors[i]}"\n'
                f'authorization {{ user: "exo", password: "{password}" }}\n'
                f'cluster {{ name: "two", listen: "127.0.0.1:{self.ports[2 + i]}", '
                f'routes: ["nats-route://127.0.0.1:{other_route}"] }}\n')
            log = open(root / f"server{i}.log", "wb")  # noqa: SIM115  # the child holds its own copy
            self.processes.append(subprocess.Popen([nats_server_binary(), "-c", str(config)], stdout=log, stderr=log))
            log.close()
        # A monitor port refuses connections until its server is up: not yet, not a failure.
        try:
            wait_until(lambda: all(self._routes(i) for i in range(2)), 15, what="the two servers routed",
                       tolerate=(httpx.TransportError,))
        except BaseException:
            self.stop()  # no fixture teardown runs for a setup that failed: leave no server behind
            raise

    def _routes(self, i: int) -> int:
        return int(httpx.get(f"http://127.0.0.1:{self.monitors[i]}/routez", timeout=2).json()["num_routes"])

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
                process.wait(10)


@pytest.fixture
def own_passwords(tmp_path: Path) -> Iterator[TwoServerCluster]:
    cluster = TwoServerCluster(tmp_path, ("password-of-a", "password-of-b"))  # as exo's embedded servers
    yield cluster
    cluster.stop()


@pytest.fixture
def shared_account(tmp_path: Path) -> Iterator[TwoServerCluster]:
    cluster = TwoServerCluster(tmp_path, ("shared", "shared"))  # as a NATS cluster run for exo
    yield cluster
    cluster.stop()


async def test_credentials_in_the_url_are_not_tried_on_servers_the_cluster_advertises(
        own_passwords: TwoServerCluster, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=CONNECTION_LOG)
    port_a, port_b = own_passwords.ports[:2]
    nc = await connect([f"nats://exo:password-of-a@127.0.0.1:{port_a}"], "exo-test")
    try:
        own_passwords.processes[0].terminate()
        await asyncio.sleep(4)
        retries = [line for line in said(caplog, logging.DEBUG) if "Connect call failed" in line]
        assert retries and all(line.endswith(f"('127.0.0.1', {port_a})") for line in retries), retries
        assert not any("Authorization Violation" in line for line in caplog.messages), caplog.messages
        assert [server.port for server in nc.servers] == [port_a] and not nc.is_connected  # B was advertised, not kept
    finally:
        await nc.close()


async def test_credentials_given_apart_from_the_url_fail_over_to_a_server_the_cluster_advertises(
        shared_account: TwoServerCluster, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=CONNECTION_LOG)
    port_a, port_b = shared_account.ports[:2]
    nc = await connect([f"nats://127.0.0.1:{port_a}"], "exo-test", NatsSecurity(user="exo", password="shared"))
    try:
        assert sorted(server.port for server in nc.servers) == sorted([port_a, port_b])
        shared_account.processes[0].terminate()
        await eventually(lambda: nc.connected_url is not None and nc.connected_url.port == port_b, timeout=10,
                         what="failover to B")
        [back] = said(caplog, logging.INFO)
        assert re.fullmatch(rf"nats \(exo-test\): reconnected to nats://127\.0\.0\.1:{port_b} after \d+\.\d s", back)
        [lost] = said(caplog, logging.WARNING)
        assert lost.endswith(f"; retrying nats://127.0.0.1:{port_a} and the servers their cluster advertises"), lost
    finally:
        await nc.close()


@pytest.fixture
async def api(fresh_server: EmbeddedNats, tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Connection]]:
    """The API in this process, and its connection to NATS."""
    nc = await connect([fresh_server.url], "exo-test")
    await provision(nc)
    view, _ = await catch_up(nc)
    ctx = ApiContext(nc, view, CommandOutcomes(nc, view), load_builtin_cards(builtin_cards_dir()), NodeId("node-a"),
                     tmp_path)
    server = TestServer(build_app(ctx))
    await server.start_server()
    async with httpx.AsyncClient(base_url=str(server.make_url("")), timeout=30) as http:
        yield http, nc
    await server.close()
    await view.stop()
    await nc.close()


async def test_events_while_nats_is_away_is_a_503_and_a_client_gone_meanwhile_no_traceback(
        api: tuple[httpx.AsyncClient, Connection], fresh_server: EmbeddedNats, caplog: pytest.LogCaptureFixture) -> None:
    http, nc = api
    caplog.set_level(logging.DEBUG)
    opened = asyncio.Event()

    async def watch_then_leave() -> None:
        async with http.stream("GET", "/events", params={"since": 0}) as held:
            assert held.status_code == 200
            opened.set()
            await asyncio.sleep(3600)  # until cancelled: the client goes away while NATS is down

    watcher = asyncio.create_task(watch_then_leave())
    await asyncio.wait_for(opened.wait(), 10)
    fresh_server.stop()
    await eventually(lambda: disconnected_for(nc) is not None, what="the loss seen")
    watcher.cancel()
    away = await http.get("/events", params={"since": 0})
    await eventually(lambda: any(m.startswith("events: the stream to ") for m in caplog.messages), what="its end")

    await fresh_server.start()
    await eventually(lambda: disconnected_for(nc) is None, timeout=10, what="reconnected")
    async with http.stream("GET", "/events", params={"since": 0}) as back:
        assert back.status_code == 200
    gc.collect()  # a task that died with an exception says so when it is collected
    tracebacks = [(r.name, r.getMessage()) for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert tracebacks == []
    assert [m for m in caplog.messages if "Error handling request" in m or "never retrieved" in m] == []
    assert away.status_code == 503 and away.headers["Retry-After"] == "5", away.text
    assert away.json()["error"]["code"] == "bus_unavailable"
