"""Prometheus metrics of one server (`GET /metrics`), on the app's own registry.

Counters and latency histograms are fed by the `TokenizerManager` as outputs
arrive (`OutputObserver`); the gauges (running and queued requests, KV token
usage, cache hit rate) are read from the scheduler when `/metrics` is scraped.
Latencies are in seconds. Names carry the `arborlm:` prefix, as SGLang's carry
`sglang:`.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """The server's Prometheus collectors; an `OutputObserver` for the tokenizer manager.

    Parameters
    ----------
    model_name: value of the `model_name` label on every series.
    """

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"arborlm:{name}", doc, labels, registry=self.registry)

        self.num_running_reqs = gauge("num_running_reqs", "requests decoding or prefilling")
        self.num_queue_reqs = gauge("num_queue_reqs", "requests waiting to be scheduled (incl. grammar compiling)")
        self.token_usage = gauge("token_usage", "fraction of KV slots held by requests (free and evictable cache slots excluded)")
        self.cache_hit_rate = gauge("cache_hit_rate", "cached prompt tokens / prompt tokens since start")
        self.prompt_tokens = Counter("arborlm:prompt_tokens", "prompt tokens of finished requests",
                                     labels, registry=self.registry)
        self.generation_tokens = Counter("arborlm:generation_tokens", "generated tokens",
                                         labels, registry=self.registry)
        self.cached_tokens = Counter("arborlm:cached_tokens", "prompt tokens served from the radix cache",
                                     labels, registry=self.registry)
        self.requests = Counter("arborlm:num_requests", "finished requests by finish reason",
                                labels + ["finish_reason"], registry=self.registry)
        self.ttft = Histogram("arborlm:time_to_first_token_seconds", "time to first token",
                              labels, buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.itl = Histogram("arborlm:inter_token_latency_seconds", "time between tokens of a request",
                             labels, buckets=ITL_BUCKETS_S, registry=self.registry)
        self.e2e = Histogram("arborlm:e2e_request_latency_seconds", "request latency, sent to finished",
                             labels, buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self._label = {"model_name": model_name}

    # ---- OutputObserver ------------------------------------------------------

    def on_tokens(self, num_tokens: int, interval_s: float, first: bool) -> None:
        """Count tokens; TTFT for the first output, else the interval split evenly over its tokens."""
        self.generation_tokens.labels(**self._label).inc(num_tokens)
        if first:
            self.ttft.labels(**self._label).observe(interval_s)
            return
        itl = self.itl.labels(**self._label)
        for _ in range(num_tokens):
            itl.observe(interval_s / num_tokens)

    def on_finish(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
                  e2e_latency_s: float, finish_reason: dict[str, Any]) -> None:
        self.prompt_tokens.labels(**self._label).inc(prompt_tokens)
        self.cached_tokens.labels(**self._label).inc(cached_tokens)
        self.requests.labels(**self._label, finish_reason=str(finish_reason.get("type"))).inc()
        self.e2e.labels(**self._label).observe(e2e_latency_s)

    # ---- scrape ---------------------------------------------------------------

    def update_from_scheduler(self, info: dict[str, Any]) -> None:
        """Set the gauges from the scheduler's live figures (`Scheduler.get_info`)."""
        total = info["max_total_tokens"]
        unused = info["free_kv_tokens"] + info["evictable_kv_tokens"]
        self.num_running_reqs.labels(**self._label).set(info["num_running_reqs"])
        self.num_queue_reqs.labels(**self._label).set(info["num_waiting_reqs"])
        self.token_usage.labels(**self._label).set((total - unused) / total if total else 0.0)
        self.cache_hit_rate.labels(**self._label).set(info["cache_hit_rate"])

    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return generate_latest(self.registry)
