"""What this node's API counts: requests, latencies, tokens, kept by prometheus-client in a
registry of this API's own (several nodes may share a process in tests). Rendered by cluster/prometheus.py."""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram

# Counters as Prometheus names them (`..._total`), without the `..._created` series beside them.
prometheus_client.disable_created_metrics()

# Seconds; time to first token on a busy CPU node can be seconds, inter-token gaps milliseconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter("exo_http_requests", "HTTP requests by route and status", ["method", "route", "status"],
                                 registry=self.registry)
        self.ttft = Histogram("exo_time_to_first_token_seconds", "from accepting a generation to its first text",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.inter_token = Histogram("exo_inter_token_latency_seconds",
                                     "time between generated tokens, per streamed chunk", buckets=ITL_BUCKETS,
                                     registry=self.registry)
        self._tokens_in = Counter("exo_prompt_tokens", "prompt tokens of finished generations", registry=self.registry)
        self._tokens_out = Counter("exo_completion_tokens", "generated tokens of finished generations",
                                   registry=self.registry)
        self._tokens_cached = Counter("exo_prompt_cached_tokens", "prompt tokens of finished generations that the "
                                      "runner's prompt cache already held", registry=self.registry)
        self._tokens_drafted = Counter("exo_draft_accepted_tokens", "generated tokens a draft model proposed and the "
                                       "model accepted (speculative decoding)", registry=self.registry)
        # A rerank's tokens count above (its pairs' prompt tokens); its documents here.
        self._reranked = Counter("exo_reranked_documents", "documents scored by finished reranks", registry=self.registry)
        # A transcription's decoded text counts above; its audio here, by the length the API measured;
        # so does the speech a text-to-speech model generated, as the API streamed it.
        self._audio = Counter("exo_audio_seconds", "seconds of audio in finished transcriptions and translations, and "
                              "of speech generated",
                              ["model"], registry=self.registry)

    def count_reranked(self, documents: int) -> None:
        self._reranked.inc(documents)

    def count_audio(self, model: str, seconds: float) -> None:
        self._audio.labels(model).inc(seconds)

    def count_request(self, method: str, route: str, status: int) -> None:
        self._requests.labels(method, route, str(status)).inc()

    def count_tokens(self, prompt: int, completion: int, cached: int = 0, drafted: int = 0) -> None:
        self._tokens_in.inc(prompt)
        self._tokens_out.inc(completion)
        self._tokens_cached.inc(cached)
        self._tokens_drafted.inc(drafted)
