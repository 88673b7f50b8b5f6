"""GET /metrics in Prometheus text format (prometheus-client), from counters this API keeps
(exo/api/metrics.py) and from State (exo/api/state_metrics.py).

Request counts, latencies and token totals are this node's API's own; queue depth, runner
status and events applied come from the State every node folds, so any node answers for the
whole cluster. Follower lag is the event stream's last sequence minus what this node applied.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from exo.api.context import context_of
from exo.bus.event_log import EventLog


async def metrics(request: web.Request) -> web.Response:
    ctx = context_of(request)
    try:
        ctx.cluster_metrics.lag = max(0, await EventLog(ctx.nc).last_sequence() - ctx.view.state.last_seq)
    except Exception:  # NATS unreachable: say so through the metric rather than fail the scrape
        ctx.cluster_metrics.lag = -1
    return web.Response(body=generate_latest(ctx.metrics.registry), headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})
