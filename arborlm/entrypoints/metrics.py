"""Prometheus metrics of one server (`GET /metrics`), on the app's own registry.

Counters and latency histograms are fed by the `TokenizerManager` as outputs
arrive (`OutputObserver`); the gauges (running and queued requests, KV token
usage, cache hit rate) and the scheduler's own counts (retracted requests,
structured-output requests) are read from the scheduler when `/metrics` is
scraped. Latencies are in seconds.

Every series is exported twice: with the `arborlm:` prefix and with SGLang's
`sglang:` prefix and names, so that dashboards and autoscalers written for
SGLang (its Grafana dashboard reads `sglang:time_to_first_token_seconds`,
`sglang:num_queue_reqs`, ...) work unchanged. Both carry the `model_name`
label, as SGLang's do.

Series (the counters end in ``_total`` in the exposition):
num_running_reqs, num_queue_reqs, token_usage, cache_hit_rate (gauges);
prompt_tokens, generation_tokens, cached_tokens, num_requests (by
finish_reason), num_aborted_requests, num_retracted_requests, num_so_requests
(counters); with the host KV tier (`--enable-hierarchical-cache`) also
device_cache_hit_rate, host_cache_hit_rate, hicache_host_token_usage (gauges)
and hicache_loaded_back_tokens (counter); time_to_first_token_seconds, inter_token_latency_seconds,
time_per_output_token_seconds (per request: (E2E - TTFT) / (output tokens - 1)),
queue_time_seconds (scheduler arrival to first admission), e2e_request_latency_seconds
(histograms).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
PREFIXES = ("arborlm", "sglang")


class _Twin:
    """One series under each prefix of `PREFIXES`; `labels(...)` returns a child that updates all."""

    def __init__(self, make: Callable[[str], Any], name: str):
        self.metrics = [make(f"{prefix}:{name}") for prefix in PREFIXES]

    def labels(self, **labels: str) -> _TwinChild:
        return _TwinChild([m.labels(**labels) for m in self.metrics])


class _TwinChild:
    def __init__(self, children: list[Any]):
        self.children = children

    def inc(self, amount: float = 1.0) -> None:
        for c in self.children:
            c.inc(amount)

    def set(self, value: float) -> None:
        for c in self.children:
            c.set(value)

    def observe(self, value: float) -> None:
        for c in self.children:
            c.observe(value)


class ServerMetrics:
    """The server's Prometheus collectors; an `OutputObserver` for the tokenizer manager.

    Parameters
    ----------
    model_name: value of the `model_name` label on every series.
    """

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        registry = self.registry

        def gauge(name: str, doc: str) -> _Twin:
            return _Twin(lambda full: Gauge(full, doc, labels, registry=registry), name)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> _Twin:
            return _Twin(lambda full: Counter(full, doc, labels + list(extra), registry=registry), name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> _Twin:
            return _Twin(lambda full: Histogram(full, doc, labels, buckets=buckets, registry=registry), name)

        self.num_running_reqs = gauge("num_running_reqs", "requests decoding or prefilling")
        self.num_queue_reqs = gauge("num_queue_reqs", "requests waiting to be scheduled (incl. grammar compiling)")
        self.token_usage = gauge("token_usage", "fraction of KV slots held by requests (free and evictable cache slots excluded)")
        self.cache_hit_rate = gauge("cache_hit_rate", "cached prompt tokens / prompt tokens since start")
        self.device_cache_hit_rate = gauge("device_cache_hit_rate",
                                           "prompt tokens found in the device KV pool / prompt tokens")
        self.host_cache_hit_rate = gauge("host_cache_hit_rate",
                                         "prompt tokens loaded back from the host KV tier / prompt tokens")
        self.hicache_host_token_usage = gauge("hicache_host_token_usage", "fraction of host-tier KV slots held")
        self.hicache_loaded_back = counter("hicache_loaded_back_tokens",
                                           "tokens copied from the host KV tier back into the device pool")
        self.spec_accept_length = gauge("spec_accept_length",
                                        "speculative decoding: mean tokens emitted per request and verify step")
        self.prompt_tokens = counter("prompt_tokens", "prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "generated tokens")
        self.cached_tokens = counter("cached_tokens", "prompt tokens served from the radix cache")
        self.requests = counter("num_requests", "finished requests by finish reason", ("finish_reason",))
        self.aborted = counter("num_aborted_requests", "requests that finished with abort")
        self.retracted = counter("num_retracted_requests", "retractions: running requests preempted when KV ran out")
        self.structured = counter("num_so_requests", "structured-output requests (a grammar constraint)")
        self.ttft = histogram("time_to_first_token_seconds", "time to first token", LATENCY_BUCKETS_S)
        self.itl = histogram("inter_token_latency_seconds", "time between tokens of a request", ITL_BUCKETS_S)
        self.tpot = histogram("time_per_output_token_seconds",
                              "per request: (e2e - ttft) / (output tokens - 1)", ITL_BUCKETS_S)
        self.queue_time = histogram("queue_time_seconds", "scheduler arrival to first admission",
                                    LATENCY_BUCKETS_S)
        self.e2e = histogram("e2e_request_latency_seconds", "request latency, sent to finished", LATENCY_BUCKETS_S)
        self._label = {"model_name": model_name}
        for series in (self.aborted, self.retracted, self.structured, self.tpot, self.queue_time):
            series.labels(**self._label)  # exported (as 0) before the first event
        # the scheduler's running totals already counted (its counters are read at scrape time)
        self._seen = {"num_retractions": 0, "num_grammar_reqs": 0, "hicache_loaded_back_tokens": 0}

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
                  e2e_latency_s: float, finish_reason: dict[str, Any], ttft_s: float | None = None,
                  queue_time_s: float | None = None) -> None:
        """Count a finished request; TPOT when it has a TTFT and two tokens or more."""
        kind = str(finish_reason.get("type"))
        self.prompt_tokens.labels(**self._label).inc(prompt_tokens)
        self.cached_tokens.labels(**self._label).inc(cached_tokens)
        self.requests.labels(**self._label, finish_reason=kind).inc()
        if kind == "abort":
            self.aborted.labels(**self._label).inc()
        self.e2e.labels(**self._label).observe(e2e_latency_s)
        if ttft_s is not None and completion_tokens > 1:
            self.tpot.labels(**self._label).observe(max(0.0, e2e_latency_s - ttft_s) / (completion_tokens - 1))
        if queue_time_s is not None:
            self.queue_time.labels(**self._label).observe(queue_time_s)

    # ---- scrape ---------------------------------------------------------------

    def update_from_scheduler(self, info: dict[str, Any]) -> None:
        """Set the gauges, and advance the counters the scheduler keeps, from its live figures
        (`Scheduler.get_info`)."""
        total = info["max_total_tokens"]
        unused = info["free_kv_tokens"] + info["evictable_kv_tokens"]
        self.num_running_reqs.labels(**self._label).set(info["num_running_reqs"])
        self.num_queue_reqs.labels(**self._label).set(info["num_waiting_reqs"])
        self.token_usage.labels(**self._label).set((total - unused) / total if total else 0.0)
        self.cache_hit_rate.labels(**self._label).set(info["cache_hit_rate"])
        self._update_hicache(info)
        if "avg_spec_accept_length" in info:  # speculation on
            self.spec_accept_length.labels(**self._label).set(info["avg_spec_accept_length"])
        for key, series in (("num_retractions", self.retracted), ("num_grammar_reqs", self.structured)):
            for step in self._advance(key, info.get(key)):
                series.labels(**self._label).inc(step)

    def _update_hicache(self, info: dict[str, Any]) -> None:
        """The host KV tier's series, when the scheduler has one (`hicache_*` figures)."""
        if "hicache_host_total_tokens" not in info:
            return
        self.device_cache_hit_rate.labels(**self._label).set(info["device_cache_hit_rate"])
        self.host_cache_hit_rate.labels(**self._label).set(info["host_cache_hit_rate"])
        host_total = info["hicache_host_total_tokens"]
        self.hicache_host_token_usage.labels(**self._label).set(info["hicache_host_used_tokens"] / host_total)
        for step in self._advance("hicache_loaded_back_tokens", info["hicache_loaded_back_tokens"]):
            self.hicache_loaded_back.labels(**self._label).inc(step)

    def _advance(self, key: str, total: int | None) -> Iterator[int]:
        """The rise of a scheduler total since the last scrape (nothing when it is absent or fell)."""
        if total is not None and total > self._seen[key]:
            yield total - self._seen[key]
            self._seen[key] = total

    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return generate_latest(self.registry)
