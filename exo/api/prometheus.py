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


_PROMPT_CACHE_METRICS = (  # (field of PromptCacheStats, metric, type, help)
    ("hits", "exo_prompt_cache_hits_total", "counter", "requests that reused a cached prompt prefix"),
    ("misses", "exo_prompt_cache_misses_total", "counter", "requests that found no cached prefix"),
    ("tokens_reused", "exo_prompt_cache_tokens_reused_total", "counter", "prompt tokens not processed again"),
    ("evictions", "exo_prompt_cache_evictions_total", "counter", "entries dropped to stay within the cache's limits"),
    ("bytes", "exo_prompt_cache_bytes", "gauge", "KV cache bytes held"),
    ("entries", "exo_prompt_cache_entries", "gauge", "cached prompts held"),
)


def _prompt_cache_metrics(state) -> list[str]:
    """Each runner's prompt cache, as its node's latest heartbeat reported it."""
    caches = [(node_id, instance_id, stats) for node_id, node in sorted(state.nodes.items())
              for instance_id, stats in sorted(node.prompt_caches.items())]
    lines: list[str] = []
    for field, name, kind, help_text in _PROMPT_CACHE_METRICS:
        lines += _metric(name, kind, f"{help_text} (per runner, from heartbeats)", (
            f'{name}{{node_id="{_label(n)}",instance_id="{_label(i)}"}} {getattr(stats, field)}' for n, i, stats in caches))
    return lines


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
        *_metric("exo_prompt_cached_tokens_total", "counter", "prompt tokens of finished generations that the "
                 "runner's prompt cache already held", [f"exo_prompt_cached_tokens_total {m.tokens_cached}"]),
        *_prompt_cache_metrics(state),
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
