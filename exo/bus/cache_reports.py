"""What each instance's prompt cache holds, on core NATS: a worker publishes its rank 0 runners'
reports on `exo.cache.<instance>`, every master listens (leading or not, so one that takes over
has them). No stream keeps them: a report is a snapshot, resent every few seconds, and a master
without one routes as it would without reports (docs/prompt-cache.md, "What each cache holds").
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from exo.bus.connection import Connection
from exo.bus.inbound import from_clients_only
from exo.bus.subjects import ALL_CACHE_REPORTS, cache_report_subject
from exo.bus.throttled_log import ThrottledLog
from exo.core.cache_reports import MAX_REPORT_BYTES, CacheReport, report_decoder

log = logging.getLogger(__name__)
_refusals = ThrottledLog(log)


async def publish_cache_report(nc: Connection, report: CacheReport) -> None:
    await nc.publish(cache_report_subject(report.instance_id), msgspec.json.encode(report))


async def listen_for_cache_reports(nc: Connection, on_report: Callable[[CacheReport], None]) -> Subscription:
    """`on_report` for each well-formed report on the subject of the instance it names; anything
    else is dropped (and logged at most once a minute): anyone with the cluster's credentials may
    publish here. Whether the report's node runs that instance is the listener's to check, on State."""

    async def received(msg: Msg) -> None:
        try:
            if len(msg.data) > MAX_REPORT_BYTES:
                raise ValueError(f"{len(msg.data)} bytes, at most {MAX_REPORT_BYTES}")
            report = report_decoder.decode(msg.data)
            if msg.subject != cache_report_subject(report.instance_id):
                raise ValueError(f"a report of instance {report.instance_id!r}")
        except (msgspec.MsgspecError, ValueError) as error:
            _refusals.warning("refused", "cache report on %s refused: %s", msg.subject, error)
            return
        on_report(report)

    return await nc.subscribe(ALL_CACHE_REPORTS, cb=from_clients_only(received))
