"""The cluster's metrics that State holds (queue depth, runners, events applied, prompt caches),
read from State at each scrape of /metrics, and this node's follower lag."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from exo.core.state import State
from exo.core.usage import UsageCounts

_PROMPT_CACHE_METRICS = (  # (field of PromptCacheStats, metric, counter or not, help)
    ("hits", "exo_prompt_cache_hits", True, "requests that reused a cached prompt prefix"),
    ("misses", "exo_prompt_cache_misses", True, "requests that found no cached prefix"),
    ("tokens_reused", "exo_prompt_cache_tokens_reused", True, "prompt tokens not processed again"),
    ("evictions", "exo_prompt_cache_evictions", True, "entries dropped to stay within the cache's limits"),
    ("bytes", "exo_prompt_cache_bytes", False, "KV cache bytes held"),
    ("entries", "exo_prompt_cache_entries", False, "cached prompts held"),
)


class ClusterCollector(Collector):
    """What State says, read at each scrape; `lag` is set by the handler just before."""

    def __init__(self, state: Callable[[], State], per_key: bool = True) -> None:
        self._state = state
        self._per_key = per_key
        self.lag = -1

    def collect(self) -> Iterator[Metric]:
        state = self._state()
        yield from _prompt_cache_metrics(state)
        yield from _usage_metrics(state, self._per_key)
        queue = Counter(t.instance_id for t in state.tasks.values() if t.status in ("pending", "running"))
        depth = GaugeMetricFamily("exo_instance_queue_depth", "open (pending or running) tasks per instance",
                                  labels=["instance_id", "model_id"])
        for instance_id, instance in sorted(state.instances.items()):
            depth.add_metric([instance_id, instance.model_id], queue.get(instance_id, 0))
        yield depth
        runners = GaugeMetricFamily("exo_runners", "runners by status", labels=["status"])
        for status, count in sorted(Counter(r.status for r in state.runners.values()).items()):
            runners.add_metric([status], count)
        yield runners
        yield CounterMetricFamily("exo_migrations", "generations moved off an instance that died (exo/master/heal.py)",
                                  value=state.migrations_total)
        waiting = GaugeMetricFamily("exo_desires_waiting", "desires short of their replicas, with why",
                                    labels=["desire_id", "model_id", "reason"])
        for desire in sorted(state.desires.values(), key=lambda d: d.desire_id):
            if desire.waiting:
                waiting.add_metric([desire.desire_id, desire.model_id, desire.waiting[:200]], 1)
        yield waiting
        yield GaugeMetricFamily("exo_events_applied", "sequence of the last event folded into this node's State",
                                value=state.last_seq)
        yield GaugeMetricFamily("exo_follower_lag_events",
                                "event stream's last sequence minus the applied one (-1: unknown)", value=self.lag)


def _prompt_cache_metrics(state: State) -> Iterator[Metric]:
    """Each runner's prompt cache, as its node's latest heartbeat reported it."""
    caches = [(node_id, instance_id, stats) for node_id, node in sorted(state.nodes.items())
              for instance_id, stats in sorted(node.prompt_caches.items())]
    for field, name, counter, help_text in _PROMPT_CACHE_METRICS:
        family = (CounterMetricFamily if counter else GaugeMetricFamily)(
            name, f"{help_text} (per runner, from heartbeats)", labels=["node_id", "instance_id"])
        for node_id, instance_id, stats in caches:
            family.add_metric([node_id, instance_id], getattr(stats, field))
        yield family


def _usage_metrics(state: State, per_key: bool) -> Iterator[Metric]:
    """Each API key's requests and tokens by model since it began (State's usage totals)."""
    labels = ["key_id", "model_id"] if per_key else ["model_id"]
    requests = CounterMetricFamily("exo_key_requests", "requests admitted, by API key and model", labels=labels)
    tokens = CounterMetricFamily("exo_key_tokens", "tokens of finished requests, by API key, model and kind",
                                 labels=[*labels, "kind"])
    summed: dict[tuple[str, ...], UsageCounts] = {}
    for key_id, models in sorted(state.usage_totals.items()):
        for model_id, counts in sorted(models.items()):
            label: tuple[str, ...] = (key_id, model_id) if per_key else (model_id,)
            summed[label] = summed.get(label, UsageCounts()).plus(counts)
    for label, counts in sorted(summed.items()):
        requests.add_metric(list(label), counts.requests)
        for kind in ("prompt", "completion", "cached"):
            tokens.add_metric([*label, kind], getattr(counts, f"{kind}_tokens"))
    yield requests
    yield tokens
