"""Reports of the serving benchmark: a markdown table of run records, and a PNG plot
(latency against request rate for Poisson runs, throughput against concurrency for
fixed-concurrency runs). A record is the JSON object `bench_serving.py` writes per run."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any


def load_records(paths: list[Path]) -> list[dict[str, Any]]:
    """Every record of the given JSON-lines files, in order."""
    records = []
    for path in paths:
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return records


def _ms(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value * 1000:.0f}"


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


def _load(record: dict[str, Any]) -> str:
    rate = record.get("request_rate")
    if rate is not None and math.isfinite(rate):
        cap = record.get("concurrency")
        return f"{rate:g} req/s" + (f" (≤{cap})" if cap else "")
    return f"c={record.get('concurrency')}"


HEADER = ("| server | workload | load | req/s | in tok/s | out tok/s | TTFT p50 / p95 (ms) | TPOT p50 / p95 (ms) "
          "| ITL p95 (ms) | E2E p50 / p95 (s) | goodput (req/s) | cache hit | errors |")


def markdown_table(records: list[dict[str, Any]]) -> str:
    """One row per record, in the order given."""
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for r in records:
        m = r["metrics"]
        hit = r.get("cache_hit_rate_server")
        if hit is None:
            hit = m.get("cache_hit_rate_client")
        lines.append(
            f"| {r['label']} | {r['workload']} | {_load(r)} | {_num(m['request_throughput'], '{:.2f}')} "
            f"| {_num(m['input_throughput'])} | {_num(m['output_throughput'])} "
            f"| {_ms(m['ttft_s']['p50'])} / {_ms(m['ttft_s']['p95'])} "
            f"| {_ms(m['tpot_s']['p50'])} / {_ms(m['tpot_s']['p95'])} | {_ms(m['itl_s']['p95'])} "
            f"| {_num(m['e2e_s']['p50'], '{:.2f}')} / {_num(m['e2e_s']['p95'], '{:.2f}')} "
            f"| {_num(m['goodput'], '{:.2f}')} | {_num(hit, '{:.0%}')} | {m['errors']}/{m['num_requests']} |"
        )
    return "\n".join(lines) + "\n"


def plot(records: list[dict[str, Any]], path: Path) -> bool:
    """Write the PNG; False (with nothing written) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    by_rate: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    by_conc: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in records:
        key = f"{r['label']} / {r['workload']}"
        m = r["metrics"]
        rate = r.get("request_rate")
        if rate is not None and math.isfinite(rate):
            by_rate[key].append((rate, m["ttft_s"]["p95"], m["e2e_s"]["p50"]))
        elif r.get("concurrency"):
            by_conc[key].append((r["concurrency"], m["output_throughput"]))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for key, points in sorted(by_rate.items()):
        points.sort()
        line = left.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{key} TTFT p95")[0]
        left.plot([p[0] for p in points], [p[2] for p in points], marker="x", linestyle="--",
                  color=line.get_color(), label=f"{key} E2E p50")
    left.set(xlabel="request rate (req/s, Poisson)", ylabel="latency (s)", title="Latency against request rate")
    for key, points in sorted(by_conc.items()):
        points.sort()
        right.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=key)
    right.set(xlabel="concurrency (clients)", ylabel="output tok/s", title="Throughput against concurrency")
    for axis, data in ((left, by_rate), (right, by_conc)):
        if data:
            axis.legend(fontsize=7)
            axis.grid(alpha=0.3)
        else:
            axis.text(0.5, 0.5, "no runs of this kind", ha="center", va="center", transform=axis.transAxes)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
