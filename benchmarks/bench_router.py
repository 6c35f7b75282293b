"""Data parallelism behind sglang-router: `cache_aware` vs `round_robin` vs one worker.

Each configuration is a fresh `arborlm serve` (one worker, or `--dp-size 2` with the
router policy), driven by `bench_serving.py` with the same seeded workload: groups of
requests sharing a long system prompt, more groups than one worker's KV pool holds
(`--max-total-tokens` per worker), so only routing that keeps each group on one worker
keeps its prefix cached. Configurations run interleaved, `--rounds` times. Per run:
throughput and TTFT from `bench_serving.py`, and the combined cache hit rate (cached /
prompt tokens summed over the workers' `/get_server_info` counters, read directly from
each worker, since the router forwards that route to one worker only).

`--kill-one` adds a `cache_aware` run in which one of the two workers is SIGKILLed
halfway, and reports how many requests failed (at most those in flight on it).

Example (the docs' table)::

    flock /tmp/arborlm-timing.lock python benchmarks/bench_router.py --rounds 2 --kill-one \\
        --markdown-out benchmarks/results/router.md
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
BENCH_SERVING = ROOT / "benchmarks" / "bench_serving.py"
START_TIMEOUT_S = 600


@dataclass(frozen=True)
class Config:
    label: str
    dp_size: int
    policy: str | None
    kill_one: bool = False
    balance_abs: int | None = None  # cache_aware: --router-balance-abs-threshold (None: the router's)


CONFIGS = (Config("1 worker", 1, None), Config("2 × round_robin", 2, "round_robin"),
           Config("2 × cache_aware", 2, "cache_aware"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(config: Config, args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    """A server for `config` on a free port, once it is ready (every worker registered)."""
    port = free_port()
    cmd = [sys.executable, "-m", "arborlm", "serve", "--port", str(port), "--log-level", "info",
           "--max-total-tokens", str(args.max_total_tokens), "--enable-cache-report", "--random-seed", "0"]
    if args.model:
        cmd += ["--model", args.model]
    if config.dp_size > 1:
        cmd += ["--dp-size", str(config.dp_size), "--router-policy", config.policy]
        if config.balance_abs is not None:
            cmd += ["--router-balance-abs-threshold", str(config.balance_abs),
                    "--router-balance-rel-threshold", str(args.balance_rel_threshold)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    marker = "workers behind sglang-router" if config.dp_size > 1 else "ready when GET /health"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{config.label}: the server exited:\n{log.read_text()[-3000:]}")
        if marker in log.read_text(errors="replace") and _healthy(url):
            return proc, url
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{config.label}: not ready in {START_TIMEOUT_S} s")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def worker_urls(url: str, dp_size: int) -> list[str]:
    """The workers' own URLs: the router's `/workers` list, or the server itself."""
    if dp_size == 1:
        return [url]
    return [w["url"] for w in httpx.get(f"{url}/workers", timeout=5).json()["workers"]]


def counters(urls: list[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for u in urls:
        try:
            out[u] = httpx.get(f"{u}/get_server_info", timeout=10).json()
        except httpx.HTTPError:
            out[u] = {}  # a killed worker
    return out


def hit_rate(before: dict[str, dict], after: dict[str, dict]) -> float | None:
    """Cached / prompt tokens over every worker that answered both times."""
    cached = prompt = 0
    for u, b in before.items():
        a = after.get(u) or {}
        if "num_prompt_tokens" in a and "num_prompt_tokens" in b:
            cached += a["num_cached_tokens"] - b["num_cached_tokens"]
            prompt += a["num_prompt_tokens"] - b["num_prompt_tokens"]
    return cached / prompt if prompt else None


def _worker_pid(url: str, server: subprocess.Popen) -> int | None:
    """The pid of the worker child listening on `url`'s port (psutil)."""
    import psutil

    port = int(url.rsplit(":", 1)[1])
    for child in psutil.Process(server.pid).children():
        if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in child.net_connections("tcp")):
            return child.pid
    return None


def run_one(config: Config, args: argparse.Namespace, workdir: Path, round_no: int) -> dict[str, Any]:
    log = workdir / f"{config.label.replace(' ', '_')}-{round_no}.log"
    server, url = start(config, args, log)
    try:
        workers = worker_urls(url, config.dp_size)
        before = counters(workers)
        out = workdir / f"run-{config.label.replace(' ', '_')}-{round_no}.jsonl"
        cmd = [sys.executable, str(BENCH_SERVING), "--base-url", url, "--label", config.label,
               "--workload", args.workload, "--num-groups", str(args.num_groups),
               "--system-len", str(args.system_len), "--question-len", "32", "--output-len", str(args.output_len),
               "--concurrency", str(args.concurrency), "--num-requests", str(args.num_requests),
               "--no-flush-cache", "--disable-progress", "--result-jsonl", str(out)]
        if args.model:
            cmd += ["--tokenizer", args.model]
        killer = None
        if config.kill_one:
            victim = _worker_pid(workers[0], server)
            killer = threading.Timer(args.kill_after, lambda: victim and os.kill(victim, signal.SIGKILL))
            killer.start()
        subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL)
        if killer is not None:
            killer.cancel()
        record = json.loads(out.read_text().splitlines()[-1])
        record["cache_hit_rate_workers"] = hit_rate(before, counters(workers))
        record["round"] = round_no
        return record
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def table(records: list[dict[str, Any]]) -> str:
    lines = ["| config | round | req/s | output tok/s | TTFT p50 / p95 (ms) | cache hit rate | errors |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        m = r["metrics"]
        hit = r["cache_hit_rate_workers"]
        lines.append(f"| {r['label']} | {r['round']} | {m['request_throughput']:.2f} | {m['output_throughput']:.1f} "
                     f"| {m['ttft_s']['p50'] * 1e3:.0f} / {m['ttft_s']['p95'] * 1e3:.0f} "
                     f"| {'-' if hit is None else f'{hit:.0%}'} | {m['errors']}/{m['num_requests']} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", help="checkpoint (default: the default model)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--workload", default="shared-prefix", choices=("shared-prefix", "agent", "multi-turn"))
    p.add_argument("--num-groups", type=int, default=8)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-total-tokens", type=int, default=3072,
                   help="KV pool per worker: fewer tokens than all groups' prompts together")
    p.add_argument("--kill-one", action="store_true", help="also a cache_aware run that kills one worker")
    p.add_argument("--kill-after", type=float, default=10.0, help="seconds into the --kill-one run")
    p.add_argument("--balance-abs-threshold", type=int,
                   help="also a cache_aware run with this --router-balance-abs-threshold (the router's "
                        "default is 64: at a few clients it never balances)")
    p.add_argument("--balance-rel-threshold", type=float, default=1.5,
                   help="that run's --router-balance-rel-threshold")
    p.add_argument("--markdown-out", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs = list(CONFIGS)
    if args.balance_abs_threshold is not None:
        configs.append(Config(f"2 × cache_aware, balance at {args.balance_abs_threshold}", 2, "cache_aware",
                              balance_abs=args.balance_abs_threshold))
    if args.kill_one:
        configs.append(Config("2 × cache_aware, one killed", 2, "cache_aware", True))
    records = []
    with tempfile.TemporaryDirectory(prefix="bench_router-") as tmp:
        for round_no in range(1, args.rounds + 1):
            for config in configs:
                print(f"round {round_no}: {config.label}", file=sys.stderr, flush=True)
                records.append(run_one(config, args, Path(tmp), round_no))
    text = table(records)
    print(text)
    if args.markdown_out:
        args.markdown_out.parent.mkdir(parents=True, exist_ok=True)
        args.markdown_out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
