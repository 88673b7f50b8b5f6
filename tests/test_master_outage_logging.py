"""A master candidate while its NATS server is away: its campaigns fail every few seconds, and it
says so once (then at most once a minute, with a count), and once that campaigning works again.
A real nats-server, stopped under it and started again."""

from __future__ import annotations

import asyncio
import logging

import pytest

from exo.bus.connection import connect
from exo.bus.leadership import Lease
from exo.bus.provision import provision
from exo.bus.server.embedded import EmbeddedNats
from exo.bus.state_view import StateView
from exo.bus.subjects import LEADER_BUCKET
from exo.bus.throttled_log import ThrottledLog
from exo.master.service import Master
from tests.support.polling import eventually

MASTER_LOG = "exo.master.service"


def campaign_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == MASTER_LOG and "campaign" in r.getMessage()]


class Candidate:
    """Master m1 campaigning on its own connection, while node "other" holds the lease (m1 loses)."""

    def __init__(self, server: EmbeddedNats, lease_s: float) -> None:
        self.server, self.lease_s = server, lease_s

    async def __aenter__(self) -> Candidate:
        self.nc = await connect([self.server.url], "campaigner")
        await provision(self.nc, overrides={f"KV_{LEADER_BUCKET}": {"max_age": int(self.lease_s * 1e9)}})
        self.other = Lease(self.nc, "other")
        assert await self.other.try_acquire() is not None
        self.view = StateView(self.nc)
        await self.view.start()
        self.running = asyncio.create_task(Master(self.nc, self.view, {}, node_id="m1").run())
        return self

    async def outage(self, seconds: float) -> None:
        self.server.stop()
        await asyncio.sleep(seconds)

    async def back(self) -> None:
        await self.server.start()  # the same port and store
        await eventually(lambda: self.nc.is_connected, timeout=15, what="reconnected")

    async def __aexit__(self, *exc: object) -> None:
        self.running.cancel()
        await asyncio.wait({self.running}, timeout=10)
        await self.view.stop()
        await self.nc.close()


def one_warning(caplog: pytest.LogCaptureFixture) -> None:
    [(level, warning)] = campaign_lines(caplog)
    assert level == "WARNING" and warning.startswith("master: ") and warning.endswith("; campaigning again")


@pytest.mark.slow  # fifteen seconds without a server
async def test_failed_campaigns_are_one_warning_and_winning_the_lease_after_them_one_info(
        fresh_server: EmbeddedNats, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=MASTER_LOG)
    async with Candidate(fresh_server, lease_s=10) as m1:  # a lost campaign sleeps 2 s
        await asyncio.sleep(3)
        assert campaign_lines(caplog) == []  # a campaign lost to a leader is no news
        await m1.outage(15)  # a campaign fails every few seconds; the lease runs out meanwhile
        one_warning(caplog)
        await m1.back()
        await eventually(lambda: m1.view.state.leader_node == "m1", timeout=30, what="m1 leads")
        await asyncio.sleep(1)
        assert campaign_lines(caplog)[1:] == [("INFO", "master: campaigning works again")]


@pytest.mark.slow  # eighteen seconds without a server
async def test_a_campaign_lost_to_the_leader_after_failed_ones_is_one_info(
        fresh_server: EmbeddedNats, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=MASTER_LOG)
    async with Candidate(fresh_server, lease_s=30) as m1:  # a lost campaign sleeps 6 s; the lease outlives the outage
        await asyncio.sleep(1)
        await m1.outage(18)
        one_warning(caplog)
        await m1.back()
        assert await m1.other.try_acquire() is not None  # "other" renews: m1's next campaign is lost again
        await eventually(lambda: len(campaign_lines(caplog)) == 2, timeout=15, what="campaigning works again")
        await asyncio.sleep(7)  # past m1's next lost campaign: nothing more to say
        assert campaign_lines(caplog)[1:] == [("INFO", "master: campaigning works again")]
        assert m1.view.state.leader_node != "m1"


def test_a_cleared_condition_is_said_at_info_only_if_it_was_said(caplog: pytest.LogCaptureFixture) -> None:
    now = [1000.0]
    throttled = ThrottledLog(logging.getLogger("test.throttled"), clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="test.throttled")
    throttled.cleared("away", "back")  # never said: nothing to end
    throttled.warning("away", "server away")
    now[0] += 1
    throttled.warning("away", "server away")  # within the minute: counted only
    throttled.cleared("away", "back after %s", "a while")
    throttled.cleared("away", "back")  # already said
    throttled.warning("away", "server away")  # news again
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "server away"), ("INFO", "back after a while"), ("WARNING", "server away")]
