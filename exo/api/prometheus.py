"""GET /metrics in Prometheus text format, from counters this API keeps and from State.

Request counts, latencies and token totals are this node's API's own; queue depth, runner
status and events applied come from the State every node folds, so any node answers for the
whole cluster. Follower lag is the event stream's last sequence minus what this node applied.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from aiohttp import web

from exo.api.context import context_of
from exo.bus.event_log import EventLog

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _metric(name: str, kind: str, help_text: str, samples: Iterable[str]) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


async def metrics(request: web.Request) -> web.Response:
    ctx = context_of(request)
    m, state = ctx.metrics, ctx.view.state
    try:
        lag = max(0, await EventLog(ctx.nc).last_sequence() - state.last_seq)
    except Exception:  # NATS unreachable: say so through the metric rather than fail the scrape
        lag = -1
    queue = Counter(t.instance_id for t in state.tasks.values() if t.status in ("pending", "running"))
    runners = Counter(r.status for r in state.runners.values())
    lines = [
        *_metric("exo_http_requests_total", "counter", "HTTP requests by route and status", (
            f'exo_http_requests_total{{method="{meth}",route="{_label(route)}",status="{status}"}} {n}'
            for (meth, route, status), n in sorted(m.requests.items()))),
        *_metric("exo_time_to_first_token_seconds", "histogram", "from accepting a generation to its first text",
                 m.ttft.lines("exo_time_to_first_token_seconds")),
        *_metric("exo_inter_token_latency_seconds", "histogram", "time between generated tokens, per streamed chunk",
                 m.inter_token.lines("exo_inter_token_latency_seconds")),
        *_metric("exo_prompt_tokens_total", "counter", "prompt tokens of finished generations", [f"exo_prompt_tokens_total {m.tokens_in}"]),
        *_metric("exo_completion_tokens_total", "counter", "generated tokens of finished generations",
                 [f"exo_completion_tokens_total {m.tokens_out}"]),
        *_metric("exo_instance_queue_depth", "gauge", "open (pending or running) tasks per instance", (
            f'exo_instance_queue_depth{{instance_id="{_label(i)}",model_id="{_label(inst.model_id)}"}} {queue.get(i, 0)}'
            for i, inst in sorted(state.instances.items()))),
        *_metric("exo_runners", "gauge", "runners by status", (f'exo_runners{{status="{s}"}} {n}' for s, n in sorted(runners.items()))),
        *_metric("exo_events_applied", "gauge", "sequence of the last event folded into this node's State",
                 [f"exo_events_applied {state.last_seq}"]),
        *_metric("exo_follower_lag_events", "gauge", "event stream's last sequence minus the applied one (-1: unknown)",
                 [f"exo_follower_lag_events {lag}"]),
    ]
    return web.Response(body=("\n".join(lines) + "\n").encode(), headers={"Content-Type": CONTENT_TYPE})
