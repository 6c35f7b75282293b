"""Serving benchmark: a streaming client for any OpenAI-compatible or SGLang-native server.

Runs workloads (`random`, `shared-prefix`, `multi-turn`, `json`, `agent`; see
`benchmarks/serving/workloads.py`) against one server on this machine, at a fixed
number of concurrent clients or with Poisson arrivals at a request rate, bounded
by a request count and/or a time limit. Per run it measures request, input-token
and output-token throughput; TTFT, TPOT, ITL and E2E latency (mean, p50, p95,
p99); goodput under `--slo-ttft` / `--slo-tpot`; the cache hit rate (from
`/get_server_info` when the server has it, else from the usage fields); errors.
Each run appends one JSON record to `--result-jsonl`; the runs of the invocation
are printed as a markdown table (`--markdown-out` writes it) and plotted
(`--plot`, PNG: latency against request rate, throughput against concurrency).

Examples::

    arborlm serve &          # 127.0.0.1:30000
    python benchmarks/bench_serving.py --label arborlm --workload shared-prefix,json,agent \\
        --concurrency 1,8,32 --num-requests 64 --slo-ttft 1 --slo-tpot 0.05
    python benchmarks/bench_serving.py --workload random --request-rate 1,2,4 --time-limit 60 \\
        --plot /tmp/latency.png
    python benchmarks/bench_serving.py --summarize benchmarks/results/serving.jsonl \\
        --markdown-out benchmarks/results/serving.md --plot benchmarks/results/serving.png

Only loopback targets are accepted. Token counts of prompts are approximate
(word text sized with the model's tokenizer, `--tokenizer`, by default the
default model's converted checkpoint); the reported counts come from the server.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import random
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.serving.client import APIS, build_payload, check_loopback, send_call  # noqa: E402
from benchmarks.serving.metrics import SLO, RequestResult, server_cache_hit_rate, summarize  # noqa: E402
from benchmarks.serving.report import load_records, markdown_table, plot  # noqa: E402
from benchmarks.serving.workloads import WORKLOADS, Message, Session, WorkloadSpec, iter_sessions  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SERVER_INFO_KEYS = ("version", "model_path", "dtype", "disable_radix_cache", "max_running_requests",
                    "schedule_policy", "attention_backend", "grammar_backend", "max_total_tokens")


# ---- the model's tokenizer -------------------------------------------------------


@dataclass(frozen=True)
class Tokenizer:
    """Counts tokens and renders chat messages with the model's template."""

    count: Callable[[str], int]
    render: Callable[[list[Message]], str]


def load_tokenizer(path: str | None) -> Tokenizer:
    """The tokenizer of the checkpoint folder `path` (default: the default model's converted folder)."""
    from transformers import AutoTokenizer

    if path is None:
        from arborlm.runtime.model_loader import resolve_checkpoint

        path = str(resolve_checkpoint(None, progress=False))
    tok = AutoTokenizer.from_pretrained(path)

    def render(messages: list[Message]) -> str:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    return Tokenizer(lambda text: len(tok.encode(text, add_special_tokens=False)), render)


# ---- the server --------------------------------------------------------------------


class Server:
    """Small synchronous probes of the target (no proxies: loopback only)."""

    def __init__(self, base_url: str) -> None:
        check_loopback(base_url)
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(base_url=self.base_url, timeout=30.0, trust_env=False)

    def wait_ready(self, timeout_s: float) -> None:
        """Poll `/v1/models` until it answers 200.

        Raises
        ------
        TimeoutError
            When it does not within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.http.get("/v1/models").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.base_url} did not answer /v1/models within {timeout_s:.0f} s")
            time.sleep(1.0)

    def model_name(self) -> str:
        """The first model `/v1/models` lists ("default" when it lists none)."""
        try:
            data = self.http.get("/v1/models").json().get("data") or []
            return data[0]["id"] if data else "default"
        except (httpx.HTTPError, ValueError, KeyError, AttributeError):
            return "default"

    def info(self) -> dict[str, Any] | None:
        """`/get_server_info`, or None where the server has no such route."""
        try:
            response = self.http.get("/get_server_info")
            return response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def flush_cache(self) -> bool:
        """Empty the server's prefix cache where it has `/flush_cache`; False where it did not."""
        try:
            return self.http.post("/flush_cache").status_code == 200
        except httpx.HTTPError:
            return False


# ---- one run -----------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """How requests arrive: `concurrency` clients each running sessions back to back,
    or Poisson session arrivals at `request_rate` per second (at most `concurrency`
    sessions at once when it is set)."""

    concurrency: int | None = None
    request_rate: float | None = None

    @property
    def name(self) -> str:
        if self.request_rate is None:
            return f"c={self.concurrency}"
        return f"rate={self.request_rate:g}" + (f",c<={self.concurrency}" if self.concurrency else "")


class Budget:
    """Bounds a run: at most `max_requests` calls, none started after `deadline` (perf_counter)."""

    def __init__(self, max_requests: int | None, deadline: float | None) -> None:
        self.max_requests = max_requests
        self.deadline = deadline
        self.issued = 0

    def exhausted(self) -> bool:
        if self.max_requests is not None and self.issued >= self.max_requests:
            return True
        return self.deadline is not None and time.perf_counter() >= self.deadline

    def take(self) -> bool:
        if self.exhausted():
            return False
        self.issued += 1
        return True


@dataclass
class RunContext:
    """What every call of a run shares."""

    http: httpx.AsyncClient
    base_url: str
    api: str
    model: str
    tokenizer: Tokenizer
    ignore_eos: bool
    temperature: float
    extra_body: dict[str, Any] | None
    budget: Budget
    results: list[RequestResult]
    bar: tqdm
    start: float


async def run_session(ctx: RunContext, session: Session) -> None:
    """Run a session's calls in order while the budget allows; a failed call ends the session."""
    script = session.start()
    call = next(script)
    while ctx.budget.take():
        payload = build_payload(ctx.api, call, ctx.model, ctx.tokenizer.render, ignore_eos=ctx.ignore_eos,
                                temperature=ctx.temperature, extra_body=ctx.extra_body)
        result = await send_call(ctx.http, ctx.base_url, ctx.api, session.workload, call, payload,
                                 ctx.tokenizer.count, ctx.tokenizer.render, ctx.start)
        ctx.results.append(result)
        ctx.bar.update(1)
        if not result.ok:
            return
        try:
            call = script.send(result.text)
        except StopIteration:
            return


async def drive(ctx: RunContext, sessions: Iterator[Session], load: Load, rng: random.Random) -> None:
    """Start sessions as `load` says until the budget is spent, then wait for them all."""
    if load.request_rate is None:
        async def client() -> None:
            while not ctx.budget.exhausted():
                await run_session(ctx, next(sessions))

        await asyncio.gather(*(client() for _ in range(load.concurrency or 1)))
        return
    limit = asyncio.Semaphore(load.concurrency) if load.concurrency else None

    async def arrival(session: Session) -> None:
        if limit is None:
            await run_session(ctx, session)
            return
        async with limit:
            await run_session(ctx, session)

    tasks = []
    while not ctx.budget.exhausted():
        tasks.append(asyncio.create_task(arrival(next(sessions))))
        await asyncio.sleep(rng.expovariate(load.request_rate))
    await asyncio.gather(*tasks)


def run_seed(seed: int, workload: str, load: Load) -> int:
    """The prompts' seed of one run: the same for every server given the same arguments."""
    return zlib.crc32(f"{seed}/{workload}/{load.name}".encode())


async def measure(args: argparse.Namespace, server: Server, tokenizer: Tokenizer, model: str,
                  spec: WorkloadSpec, load: Load) -> dict[str, Any]:
    """One run: warm up, flush the cache, send the workload, return its record."""
    seed = run_seed(args.seed, spec.name, load)
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as http:
        if args.warmup:
            await _warm_up(args, http, server, tokenizer, model, spec)
        flushed = server.flush_cache() if args.flush_cache else False
        before = server.info()
        budget_start = time.perf_counter()
        budget = Budget(args.num_requests, budget_start + args.time_limit if args.time_limit else None)
        desc = f"{args.label} {spec.name} {load.name}"
        with tqdm(total=args.num_requests, desc=desc, unit="req", file=sys.stderr,
                  disable=args.disable_progress) as bar:
            ctx = RunContext(http, server.base_url, args.api, model, tokenizer, not args.no_ignore_eos,
                             args.temperature, args.extra_body, budget, [], bar, budget_start)
            await drive(ctx, iter_sessions(spec, tokenizer.count, seed), load, random.Random(seed + 1))
        duration = time.perf_counter() - budget_start
    after = server.info()
    slo = SLO(args.slo_ttft, args.slo_tpot)
    return {
        "label": args.label,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "base_url": server.base_url,
        "api": args.api,
        "model": model,
        "workload": spec.name,
        "spec": asdict(spec),
        "concurrency": load.concurrency,
        "request_rate": load.request_rate,
        "num_requests_limit": args.num_requests,
        "time_limit_s": args.time_limit,
        "seed": seed,
        "ignore_eos": not args.no_ignore_eos,
        "temperature": args.temperature,
        "cache_flushed": flushed,
        "metrics": summarize(ctx.results, duration, slo),
        "cache_hit_rate_server": server_cache_hit_rate(before, after),
        "server": {k: after[k] for k in SERVER_INFO_KEYS if after and k in after},
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
    }


async def _warm_up(args, http, server, tokenizer, model, spec) -> None:
    """Send the first calls of `args.warmup` sessions of another seed (not measured)."""
    sessions = iter_sessions(spec, tokenizer.count, args.seed + 7919)
    for _ in range(args.warmup):
        session = next(sessions)
        call = next(session.start())
        payload = build_payload(args.api, call, model, tokenizer.render, ignore_eos=not args.no_ignore_eos,
                                temperature=args.temperature, extra_body=args.extra_body)
        result = await send_call(http, server.base_url, args.api, spec.name, call, payload,
                                 tokenizer.count, tokenizer.render, time.perf_counter())
        if not result.ok:
            print(f"warm-up request failed: {result.error}", file=sys.stderr)


# ---- command line ----------------------------------------------------------------------


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    return lambda text: [kind(part) for part in text.split(",") if part.strip()]


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def loads_of(args: argparse.Namespace) -> list[Load]:
    """The loads to run: one per request rate (inf = all at once: `--max-concurrency` clients,
    else `--num-requests`), else one per concurrency."""
    if args.request_rate:
        loads = []
        for rate in args.request_rate:
            if math.isinf(rate):
                if not (args.max_concurrency or args.num_requests):
                    raise SystemExit("--request-rate inf needs --max-concurrency or --num-requests")
                loads.append(Load(concurrency=args.max_concurrency or args.num_requests))
            else:
                loads.append(Load(concurrency=args.max_concurrency, request_rate=rate))
        return loads
    return [Load(concurrency=c) for c in args.concurrency]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    target = p.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:30000", help="server root (loopback only)")
    target.add_argument("--api", choices=APIS, default="chat",
                        help="chat: /v1/chat/completions; completions: /v1/completions; generate: /generate")
    target.add_argument("--model", help="model name sent to OpenAI routes; default the first of /v1/models")
    target.add_argument("--tokenizer", help="checkpoint folder whose tokenizer sizes prompts and renders chat "
                        "for completions/generate; default the default model's converted folder")
    target.add_argument("--label", default="arborlm", help="the server's name in the records and tables")
    target.add_argument("--wait-ready", type=float, default=0.0, metavar="S",
                        help="wait up to S seconds for /v1/models to answer first")
    work = p.add_argument_group("workload (sizes in tokens)")
    work.add_argument("--workload", type=_csv(str), default=["shared-prefix"],
                      help=f"comma list of: {', '.join(WORKLOADS)}")
    for name, default in (("input-len", 256), ("output-len", 64), ("num-groups", 4), ("system-len", 512),
                          ("question-len", 48), ("num-turns", 4), ("agent-steps", 3), ("observation-len", 48)):
        work.add_argument(f"--{name}", type=int, default=default)
    work.add_argument("--range-ratio", type=float, default=0.5, help="random: lengths drawn from [len*ratio, len]")
    work.add_argument("--seed", type=int, default=0)
    arrivals = p.add_argument_group("arrivals and bounds")
    arrivals.add_argument("--concurrency", type=_csv(_positive_int), default=[8],
                          help="comma list: clients running sessions back to back (one run each)")
    arrivals.add_argument("--request-rate", type=_csv(_positive_float), default=None,
                          help="comma list of Poisson session arrival rates per second (one run each; "
                               "inf = all at once); replaces --concurrency")
    arrivals.add_argument("--max-concurrency", type=_positive_int, help="with --request-rate: at most this many sessions at once")
    arrivals.add_argument("--num-requests", type=_count, default=64, help="requests per run (0: no count bound)")
    arrivals.add_argument("--time-limit", type=_positive_float, help="seconds per run after which no request starts")
    arrivals.add_argument("--warmup", type=_count, default=1, help="unmeasured requests before each run")
    arrivals.add_argument("--no-flush-cache", dest="flush_cache", action="store_false",
                          help="do not POST /flush_cache before each run")
    arrivals.add_argument("--request-timeout", type=_positive_float, default=600.0, help="seconds per request")
    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--no-ignore-eos", action="store_true",
                          help="never send ignore_eos (for servers that refuse unknown fields)")
    sampling.add_argument("--extra-body", type=json.loads, help="JSON object merged into every request body")
    metrics = p.add_argument_group("metrics and output")
    metrics.add_argument("--slo-ttft", type=_positive_float, help="goodput: TTFT limit, seconds")
    metrics.add_argument("--slo-tpot", type=_positive_float, help="goodput: TPOT limit, seconds")
    metrics.add_argument("--result-jsonl", type=Path, default=RESULTS / "serving.jsonl",
                         help="append one JSON record per run here")
    metrics.add_argument("--markdown-out", type=Path, help="write the markdown table here")
    metrics.add_argument("--plot", type=Path, help="write the PNG plot here")
    metrics.add_argument("--summarize", type=Path, nargs="+", metavar="JSONL",
                         help="only build the table and plot from these record files")
    metrics.add_argument("--disable-progress", action="store_true")
    args = p.parse_args(argv)
    args.num_requests = args.num_requests or None
    if args.num_requests is None and not args.time_limit and not args.summarize:
        p.error("give --num-requests or --time-limit (a run needs a bound)")
    unknown = [w for w in args.workload if w not in WORKLOADS]
    if unknown:
        p.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        p.error("--extra-body must be a JSON object")
    if not args.summarize:
        try:
            check_loopback(args.base_url)
        except ValueError as e:
            p.error(str(e))
    return args


def report(records: list[dict[str, Any]], args: argparse.Namespace) -> None:
    table = markdown_table(records)
    print(table)
    if args.markdown_out:
        args.markdown_out.parent.mkdir(parents=True, exist_ok=True)
        args.markdown_out.write_text(table)
    if args.plot and not plot(records, args.plot):
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)


def _clean(value: Any) -> Any:
    """NaN → None, so the records are strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarize:
        report(load_records(args.summarize), args)
        return 0
    server = Server(args.base_url)
    if args.wait_ready:
        server.wait_ready(args.wait_ready)
    model = args.model or server.model_name()
    tokenizer = load_tokenizer(args.tokenizer)
    records = []
    for name in args.workload:
        spec = WorkloadSpec(name, args.input_len, args.output_len, args.range_ratio, args.num_groups,
                            args.system_len, args.question_len, args.num_turns, args.agent_steps,
                            args.observation_len)
        for load in loads_of(args):
            record = _clean(asyncio.run(measure(args, server, tokenizer, model, spec, load)))
            records.append(record)
            args.result_jsonl.parent.mkdir(parents=True, exist_ok=True)
            with args.result_jsonl.open("a") as f:
                f.write(json.dumps(record) + "\n")
    report(records, args)
    dead = [r["metrics"] for r in records if r["metrics"]["errors"] and not r["metrics"]["completed"]]
    if dead:
        print(f"every request of {len(dead)} run(s) failed (first: {next(iter(dead[0]['error_kinds']))}); "
              f"is the server at {args.base_url} up?", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
