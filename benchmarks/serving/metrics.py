"""What the timings of a run mean: throughput, latency percentiles, goodput, cache hits.

Definitions (per request, from the client's clock):

- TTFT: send → first chunk carrying output text.
- ITL: the gaps between consecutive chunks carrying output text.
- TPOT: (E2E − TTFT) / (completion_tokens − 1), for requests with ≥ 2 output tokens.
- E2E: send → last byte of the response.
- Throughput over the run's duration (first send → last answer): requests/s,
  input tok/s (prompt tokens), output tok/s (completion tokens), of completed
  requests only.
- Goodput: completed requests/s whose TTFT and TPOT are within the SLO given
  (a limit left out does not count); None without any SLO.
- Cache hit rate: cached prompt tokens / prompt tokens.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 95, 99)


@dataclass
class RequestResult:
    """One request's outcome.

    start_s: send time, seconds since the run started.
    ttft_s, e2e_s: None when the request failed (ttft_s also when no text came).
    itl_s: gaps between text chunks, seconds.
    cached_tokens: None when the server did not say.
    usage_reported: token counts came from the server (else from the local tokenizer).
    json_valid: for json requests, whether the answer parsed as a JSON object (None when it
        was cut by max_tokens).
    """

    workload: str
    ok: bool
    start_s: float = 0.0
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    usage_reported: bool = False
    finish_reason: str | None = None
    text: str = ""
    json_valid: bool | None = None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


@dataclass(frozen=True)
class SLO:
    """Latency limits for goodput, seconds (None: no limit)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None

    def met(self, result: RequestResult) -> bool:
        if not result.ok:
            return False
        if self.ttft_s is not None and (result.ttft_s is None or result.ttft_s > self.ttft_s):
            return False
        tpot = result.tpot_s
        return self.tpot_s is None or tpot is None or tpot <= self.tpot_s


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: list[float]) -> dict[str, float]:
    """{"mean", "p50", "p95", "p99"} of `values` (NaN for none)."""
    out = {"mean": sum(values) / len(values) if values else math.nan}
    out.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    return out


def summarize(results: list[RequestResult], duration_s: float, slo: SLO = SLO()) -> dict[str, Any]:
    """The metrics of one run (see the module docstring); seconds and tokens per second."""
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    duration_s = max(duration_s, 1e-9)
    prompt = sum(r.prompt_tokens for r in done)
    completion = sum(r.completion_tokens for r in done)
    reported = [r for r in done if r.cached_tokens is not None]
    json_checked = [r for r in done if r.json_valid is not None]
    return {
        "num_requests": len(results),
        "completed": len(done),
        "errors": len(failed),
        "error_kinds": dict(Counter((r.error or "?")[:120] for r in failed).most_common(5)),
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s,
        "input_throughput": prompt / duration_s,
        "output_throughput": completion / duration_s,
        "total_prompt_tokens": prompt,
        "total_completion_tokens": completion,
        "mean_prompt_tokens": prompt / len(done) if done else math.nan,
        "mean_completion_tokens": completion / len(done) if done else math.nan,
        "usage_reported_share": sum(r.usage_reported for r in done) / len(done) if done else math.nan,
        "ttft_s": distribution([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_s": distribution([t for r in done if (t := r.tpot_s) is not None]),
        "itl_s": distribution([gap for r in done for gap in r.itl_s]),
        "e2e_s": distribution([r.e2e_s for r in done if r.e2e_s is not None]),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "goodput": sum(slo.met(r) for r in done) / duration_s if slo.given else None,
        "slo_attainment": sum(slo.met(r) for r in done) / len(results) if slo.given and results else None,
        "cache_hit_rate_client": (sum(r.cached_tokens for r in reported) / sum(r.prompt_tokens for r in reported)
                                  if reported and sum(r.prompt_tokens for r in reported) else None),
        "json_valid_rate": sum(r.json_valid for r in json_checked) / len(json_checked) if json_checked else None,
    }


def server_cache_hit_rate(before: dict[str, Any] | None, after: dict[str, Any] | None) -> float | None:
    """Cached / prompt tokens between two `/get_server_info` answers (arborlm's counters), or None."""
    keys = ("num_cached_tokens", "num_prompt_tokens")
    if not before or not after or not all(k in before and k in after for k in keys):
        return None
    prompt = after["num_prompt_tokens"] - before["num_prompt_tokens"]
    return (after["num_cached_tokens"] - before["num_cached_tokens"]) / prompt if prompt > 0 else None
