"""A key's day is the UTC day whatever the machine's time zone: usage by day and the daily quota,
folded and decided as the master does, under a zone west of UTC and one east of it (each
machine of a cluster folds the same log, so a local day would count differently on each)."""

from __future__ import annotations

import calendar
import time
from collections.abc import Iterator

import pytest

from exo.core.events import TaskCreated
from exo.core.keys import KeyLimits
from tests.test_keys import KEY, MODEL, Cluster, refused

UTC_MIDNIGHT = float(calendar.timegm((2027, 3, 2, 0, 0, 0)))  # before New York's daylight saving time starts


@pytest.fixture(params=[("America/New_York", -5 * 3600), ("Asia/Kolkata", 5 * 3600 + 1800)], ids=lambda zone: zone[0])
def local_zone(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[float]:
    """The zone's offset from UTC in seconds, with TZ set to it for the test."""
    zone, offset = request.param
    monkeypatch.setenv("TZ", zone)
    time.tzset()
    assert time.localtime(UTC_MIDNIGHT).tm_gmtoff == offset  # the zone is in effect
    yield offset
    monkeypatch.undo()
    time.tzset()


def test_usage_counts_by_utc_day_under_a_local_zone(local_zone):
    cluster = Cluster(KeyLimits())
    for at in (UTC_MIDNIGHT - 1, UTC_MIDNIGHT, UTC_MIDNIGHT + 5 * 3600, UTC_MIDNIGHT + 86399):
        cluster.finish(cluster.ask(at), 1, 2)
    assert {day: models[MODEL].requests for day, models in cluster.state.usage[KEY.key_id].items()} == {
        "2027-03-01": 1, "2027-03-02": 3}


def test_the_daily_quota_resets_at_utc_midnight_under_a_local_zone(local_zone):
    cluster = Cluster(KeyLimits(tokens_per_day=100))
    cluster.finish(cluster.ask(UTC_MIDNIGHT - 3600), 60, 40)  # the whole quota, an hour before UTC midnight
    late = refused(cluster.ask(UTC_MIDNIGHT - 1))
    assert "used 100 tokens today (UTC)" in late.reason and late.retry_after_s == pytest.approx(1)
    assert isinstance(cluster.ask(UTC_MIDNIGHT), TaskCreated)


def test_the_daily_quota_holds_across_local_midnight(local_zone):
    local_midnight = UTC_MIDNIGHT - local_zone  # both half hours either side lie in one UTC day
    cluster = Cluster(KeyLimits(tokens_per_day=100))
    cluster.finish(cluster.ask(local_midnight - 1800), 60, 40)
    late = refused(cluster.ask(local_midnight + 1800))
    assert "used 100 tokens today (UTC)" in late.reason
