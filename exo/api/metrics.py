"""What this node's API counts: requests, latencies, tokens. Rendered by prometheus.py."""

from __future__ import annotations

import bisect
import time
from collections import Counter

# Seconds; time to first token on a busy CPU node can be seconds, inter-token gaps milliseconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        out, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            running += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{{labels}{"," if labels else ""}le="{le}"}} {running}')
        suffix = f"{{{labels}}}" if labels else ""
        return [*out, f"{name}_sum{suffix} {self.total}", f"{name}_count{suffix} {self.count}"]


class Metrics:
    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str, int]] = Counter()  # (method, route, status)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.inter_token = Histogram(ITL_BUCKETS)
        self.tokens_in = 0
        self.tokens_out = 0
        self.tokens_cached = 0
        self.started = time.time()

    def count_request(self, method: str, route: str, status: int) -> None:
        self.requests[(method, route, status)] += 1

    def count_tokens(self, prompt: int, completion: int, cached: int = 0) -> None:
        self.tokens_in += prompt
        self.tokens_out += completion
        self.tokens_cached += cached
